"""The oscar-export command line (entry point oscar_export.cli:main)."""

from .main import main

__all__ = ["main"]
