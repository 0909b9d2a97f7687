"""Ctrl-C held back while tfremat puts the user's state back."""

import signal
import threading

import pytest

from tfremat.core import interrupts_deferred


def test_ctrl_c_inside_the_block_is_raised_when_it_ends(ctrl_c_raises):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_ctrl_c_nothing_is_raised_and_the_handler_is_put_back():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with interrupts_deferred():
            pass
        assert seen == []
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            assert seen == []  # held
        assert seen == [signal.SIGINT]  # the user's handler ran once, afterwards
    finally:
        signal.signal(signal.SIGINT, previous)


def test_off_the_main_thread_it_changes_nothing():
    errors = []

    def run():
        try:
            with interrupts_deferred():
                pass
        except Exception as e:  # signal.signal raises off the main thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == []
