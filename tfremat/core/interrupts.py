"""Ctrl-C held back while tfremat puts the user's state back."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Holds Ctrl-C (SIGINT) back until the block ends, then delivers it.

    tfremat restores variables and puts a model's attributes back in `finally`
    blocks; a Ctrl-C landing halfway through would leave some restored and
    some not. Inside this block it waits: the handler that was in place runs
    once the block is done (Python's raises `KeyboardInterrupt` there). Off the
    main thread, where Python delivers no signal, it does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
