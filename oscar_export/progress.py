"""Progress bars for long work, on stderr so JSON on stdout stays clean."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import track

T = TypeVar("T")
_console = Console(stderr=True)


def progress(items: Iterable[T], description: str) -> Iterator[T]:
    return track(items, description=description, console=_console, transient=True)


def note(message: str) -> None:
    """One line on stderr: on a terminal beside the bars, and kept in a redirected log."""
    _console.print(message, markup=False, highlight=False, soft_wrap=True)
