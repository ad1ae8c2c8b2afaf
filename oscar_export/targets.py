"""Export targets: one thin recipe per target in the repository's targets/ folder.

A recipe (TOML) names the target's runtime, the CLI module that exports, runs and benchmarks
its artifacts, and the runtimes `run` and `bench` accept for it. Adding a target is a recipe
plus that module.
"""

from __future__ import annotations

import importlib
import importlib.util
import tomllib
from functools import cache
from pathlib import Path

from .config import OscarInputError

RECIPE_DIR = Path(__file__).resolve().parent.parent / "targets"
TARGETS = ("android", "ios", "laptop")


@cache
def recipe(target: str) -> dict:
    if target not in TARGETS:
        raise OscarInputError(f"target {target!r}: expected one of {TARGETS}")
    path = RECIPE_DIR / f"{target}.toml"
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise OscarInputError(f"target recipe {path} is unreadable ({err}): expected the repository's "
                              "targets/ folder next to the oscar_export package (pip install -e .)") from None


def cli_module(target: str):
    """The target's CLI module, or None while the target is not available in this version."""
    try:
        return importlib.import_module(recipe(target)["cli"])
    except ModuleNotFoundError as err:
        if err.name == recipe(target)["cli"]:
            return None
        raise


def available(target: str) -> bool:
    return importlib.util.find_spec(recipe(target)["cli"]) is not None


def run_runtimes() -> tuple[str, ...]:
    return tuple(dict.fromkeys(r for t in TARGETS for r in recipe(t)["run_runtimes"]))


def bench_runtimes() -> dict[str, str]:
    """bench runtime -> target."""
    return {r: t for t in TARGETS for r in recipe(t)["bench_runtimes"]}
