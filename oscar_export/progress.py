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
