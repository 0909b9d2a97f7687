"""Progress display for long planning, with `rich` (no Keras import here).

With `verbose=1` the display appears only once planning has taken
`DELAY_SECONDS`, so quick plans print nothing; `verbose=2` shows it at once and
leaves it on screen. Nested calls (`tfremat.plan` tracing, then planner "auto", then a
DP) add their lines to the display already there rather than opening another.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Protocol

#: Seconds of planning before the progress display appears.
DELAY_SECONDS = 2.0


class Advance(Protocol):
    def __call__(self, n: int = 1, description: str | None = None) -> None: ...


class Track(Protocol):
    def __call__(self, description: str, total: int | None) -> Advance: ...


_shown: list[Any] = []  # the rich Progress of the outermost `progress`, if any


@contextlib.contextmanager
def progress(verbose: int, delay: float = DELAY_SECONDS) -> Iterator[Track | None]:
    """Yields `track(description, total) -> advance(n, description=None)` when
    verbose, else None.

    Args:
        verbose: 0 for silence; 1 for a `rich` progress display that appears
            after `delay` seconds and disappears when done; 2 or more to show it
            at once and leave it on screen.
        delay: Seconds before the display appears (`verbose=1`).
    """
    if not verbose:
        yield None
        return
    if _shown:
        yield _tracker(_shown[-1])
        return
    from rich.progress import (BarColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn)

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   TimeElapsedColumn(), transient=verbose < 2)
    lock = threading.Lock()
    state = {"started": False, "done": False}

    def show() -> None:
        with lock:
            if not state["done"]:
                bar.start()
                state["started"] = True

    timer = threading.Timer(delay, show)
    timer.daemon = True
    _shown.append(bar)
    if verbose >= 2:
        show()
    else:
        timer.start()
    try:
        yield _tracker(bar)
    finally:
        _shown.pop()
        timer.cancel()
        with lock:
            state["done"] = True
            if state["started"]:
                bar.stop()


def _tracker(bar: Any) -> Track:
    def track(description: str, total: int | None) -> Advance:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1, description: str | None = None) -> None:
            bar.update(task, advance=n, description=description)

        return advance

    return track
