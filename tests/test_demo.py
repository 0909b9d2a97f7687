"""The demo's step timing: steps of the final plan, its first step left out."""

import types

from tfremat import demo


def test_step_time_counts_the_final_plans_steps_after_its_first(monkeypatch):
    """A re-plan's trials and the retrace after it are not step time: the demo once
    reported 3.85x the plain step for a plan whose steps took about 1.1x."""
    now = [0.0]
    monkeypatch.setattr(demo.time, "perf_counter", lambda: now[0])
    planner = types.SimpleNamespace(plan=None)
    timer = demo._StepTimer(planner)
    timer.on_train_begin()
    first, replanned = object(), object()
    # (plan in use when the step starts, its seconds)
    for plan, seconds in [(None, 30.0), (first, 5.0), (first, 1.0), (first, 1.0),
                          (replanned, 20.0), (replanned, 2.0), (replanned, 4.0)]:
        planner.plan = plan
        timer.on_train_batch_begin(0)
        now[0] += seconds
        timer.on_train_batch_end(0)
    assert timer.seconds_per_step == 3.0


def test_without_a_planner_every_step_but_the_first_counts(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(demo.time, "perf_counter", lambda: now[0])
    timer = demo._StepTimer()
    timer.on_train_begin()
    for seconds in (9.0, 1.0, 3.0):
        timer.on_train_batch_begin(0)
        now[0] += seconds
        timer.on_train_batch_end(0)
    assert timer.seconds_per_step == 2.0
