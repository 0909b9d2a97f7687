"""The planning progress display: only for long planning, one display when nested."""

import time

from tfremat.planners import _progress, progress


def test_silent_when_not_verbose():
    with progress(0) as track:
        assert track is None


def test_quick_planning_shows_nothing():
    with progress(1, delay=5.0) as track:
        track("quick", 1)(1)
        bar = _progress._shown[-1]
    assert not bar.live.is_started and not _progress._shown


def test_long_planning_shows_one_display_for_nested_calls():
    with progress(1, delay=0.05) as track:
        outer = track("planner auto", 2)
        with progress(1) as inner:
            inner("approximate DP", 1)(1)
        outer(1, description="planner auto: trying chen-sqrt")
        time.sleep(0.5)
        bar = _progress._shown[-1]
        assert len(_progress._shown) == 1 and bar.live.is_started
        assert [t.description for t in bar.tasks] == [
            "planner auto: trying chen-sqrt", "approximate DP"]
    assert not bar.live.is_started and not _progress._shown


def test_verbose_2_shows_at_once_and_stays():
    with progress(2, delay=5.0) as track:
        track("exact DP", 1)(1)
        time.sleep(0.3)
        bar = _progress._shown[-1]
        assert bar.live.is_started and not bar.live.transient
