"""Progress display for long planners, with `rich` (no Keras import here)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

Track = Callable[[str, int], Callable[[int], None]]


@contextlib.contextmanager
def progress(verbose: int) -> Iterator[Track | None]:
    """Yields `track(description, total) -> advance(n)` when verbose, else None.

    Args:
        verbose: 0 for silence, 1 or more for a `rich` progress display.
    """
    if not verbose:
        yield None
        return
    from rich.progress import Progress

    with Progress(transient=verbose < 2) as bar:
        def track(description: str, total: int) -> Callable[[int], None]:
            task = bar.add_task(description, total=total)
            return lambda n: bar.advance(task, n)

        yield track
