"""One-call entry points: plan a model under a budget, and rewrite it.

Also the checks every public entry point makes at the door (budgets, planner
and objective names), so that a bad argument is reported where it was given.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import time
from typing import Any, Callable, Iterator

import keras
import numpy as np
import tensorflow as tf

from tfremat.backend import device_name, multi_worker, xla_compiled
from tfremat.core import MIB, BudgetError, Plan, PlanGraph, Segment, check_count, warn
from tfremat.graph import extract
from tfremat.memory import MeasuredPeak, require_measurable_scope
from tfremat.planners import (OBJECTIVES, PLANNERS, chen_sqrt, every_unit_segments, make_plan,
                              progress)
from tfremat.rewriter import (UNIT_CLASSES, PlanInstallation, choose_updates,
                              compiles_segments, rewrite_model,
                              train_units_compiled_under_xla, unit_layers, unwrapped)
from tfremat.simulation import simulate

logger = logging.getLogger("tfremat")

#: Seconds `measured_choice` may spend measuring plans by default. A trial of a
#: small CNN takes 2-5 s on a 2-core CPU; under XLA every trial compiles its
#: step, and planning a small CNN for a tight budget took 343 s.
MEASURE_TIME_LIMIT = 300.0


def check_budget_mb(budget_mb: Any, name: str = "budget_mb") -> float:
    """`budget_mb` as a float, or a clear error.

    Raises:
        TypeError: not a real number (a string, None, a bool).
        ValueError: not finite, or not positive.
    """
    return check_positive(budget_mb, name, "MiB")


def check_positive(value: Any, name: str, unit: str) -> float:
    """`value`, a positive finite number of `unit`, as a float, or a clear error.

    Raises:
        TypeError: not a real number (a string, None, a bool).
        ValueError: not finite, or not positive.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of {unit}, got {value!r} "
                        f"({type(value).__name__}).")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a positive, finite number of {unit}, got {value!r}.")
    return number


def check_verbose(verbose: Any) -> int:
    """`verbose` as 0, 1 or 2 (a bool as 0 or 1), or a clear error (ValueError)."""
    if verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1 or 2, got {verbose!r}.")
    return int(verbose)


def check_planner(planner: str, objective: str, offload: bool | str = "auto",
                  update_in_backward: bool | str = False,
                  pin_order: bool | str = "auto") -> None:
    """Raises ValueError for an unknown planner, objective, offload,
    update_in_backward or pin_order setting."""
    if planner != "auto" and planner not in PLANNERS:
        raise ValueError(f"Unknown planner {planner!r}; choose 'auto' or one of "
                         f"{sorted(PLANNERS)}.")
    if objective not in OBJECTIVES:
        raise ValueError(f"Unknown objective {objective!r}; choose one of {OBJECTIVES}.")
    if offload not in (True, False, "auto"):
        raise ValueError(f"offload must be True, False or 'auto', got {offload!r}.")
    if update_in_backward not in (True, False, "auto"):
        raise ValueError("update_in_backward must be True, False or 'auto', got "
                         f"{update_in_backward!r}.")
    if not (isinstance(pin_order, bool) or pin_order == "auto"):
        raise ValueError(f"pin_order must be True, False or 'auto', got {pin_order!r}.")


def pinned(pin_order: bool | str, model: keras.Model | None = None) -> bool:
    """Whether a plan of `model` pins its backward pass (`Plan.pin_order`).

    `"auto"` pins on a CPU, where TensorFlow's executor runs a step's ready
    operations on its inter-op threads. Measured there (two threads, SGD, 96
    px, batch 16, `benchmarks/step_drift.py`): pinned, each of twelve
    planners' plans of ResNet50, ResNet152, VGG19, DenseNet121, MobileNetV2
    and InceptionV3 held the same bytes before every step, and its median
    step peaked no higher than unpinned (up to 11% lower), at 0.98x-1.07x the
    step time (`benchmarks/repeatability.py`). On one thread the free order
    kept what recomputation freed (a residual CNN's plan predicted at 141 MiB
    measured 227-239, pinned 136-140). It pins too in a multi-worker
    strategy's scope, where no `Planner` measures the plan (docs/scaling.md).
    A GPU runs its kernels one at a time on its compute stream, and XLA
    orders the program it compiles itself (`model.jit_compile`): not pinned
    there.
    """
    if pin_order == "auto":
        if xla_compiled(model):
            return False
        return not device_name().startswith("GPU") or multi_worker()
    return bool(pin_order)


def deprecated_strategy(strategy: str | None, objective: str) -> str:
    """The objective, taking the deprecated `strategy=` keyword into account."""
    if strategy is None:
        return objective
    warn("tfremat: `strategy=` is now called `objective=` (\"time\" or "
         "\"memory\"); `strategy=` will be removed.", DeprecationWarning)
    return strategy


def plan(model: keras.Model, budget_mb: float, *, batch_size: int | None = None,
         sample: Any = None, planner: str = "auto", objective: str = "time",
         offload: bool | str = "auto", time_limit: float = 60.0, verbose: int = 0,
         graph: PlanGraph | None = None, measure: bool = False, max_trials: int = 3,
         measure_time_limit: float | None = MEASURE_TIME_LIMIT,
         strategy: str | None = None, update_in_backward: bool | str = "auto",
         pin_order: bool | str = "auto", **settings: Any) -> Plan:
    """Plans what to recompute so one training step fits `budget_mb`.

    Args:
        model: A built Keras model, or one a `sample` with targets builds (as
            `fit` builds it). A compiled one is planned with its loss and
            optimizer; an uncompiled one with a mean-square loss of its outputs
            and SGD (no optimizer slots): compile it first to plan your step.
        budget_mb: Memory budget of ONE device in MiB (2**20 bytes) for the whole
            step, weights and optimizer state included, as
            `tf.config.experimental.get_memory_info(device)["peak"]` reports it.
            Under data parallelism every replica needs this much.
        batch_size: Batch size, when shapes come from `model.inputs`. Under a
            `tf.distribute` strategy, the per-replica batch (global batch //
            `strategy.num_replicas_in_sync`).
        sample: One batch `(x, y)` or a `tf.data.Dataset`, instead of `batch_size`.
        planner: `"auto"` or one of `"chen-sqrt"`, `"chen-greedy"`,
            `"chen-drop-cheap"`, `"chen-recursive"`, `"exact-dp"`, `"approx-dp"`,
            `"swap"`, `"dqn"`, `"every-unit"` (each unit recomputed on its own).
        objective: `"time"` (least recomputation under the budget) or `"memory"`
            (Kusumoto et al.'s memory-centric strategy) for the DP planners.
        offload: Let planner `"auto"` offload activations to host memory when
            recomputation alone cannot meet the budget, and planner `"dqn"`
            swap outputs out: True, False, or `"auto"` (on when a GPU exists,
            so that there is a host to offload to).
        time_limit: Seconds the exact DP may take before falling back.
        verbose: 1 shows what planning is doing (tracing, the planners "auto"
            tries, the DPs' progress) once it has taken more than two seconds;
            2 shows it at once and leaves it on screen.
        graph: The model's PlanGraph, if already extracted.
        measure: Measure, then choose: run the planned step (and, when it
            measures over the budget, plans made for lower budgets) on data of
            the batch's shapes, restoring every variable afterwards
            (`tfremat.measure_peak`), and return the plan of least predicted
            overhead whose measured peak fits with room for its spread (the
            step without recomputation or offload is measured too when no
            plan has room, and returned when it measures lower). The
            simulator misses what kernels and the allocator do in ways it
            cannot see (XLA, cuDNN workspaces, the allocator's rounding); this
            catches it.
        max_trials: Most plans measured when `measure` is True (the step
            without recomputation aside).
        measure_time_limit: Seconds measuring may take when `measure` is True
            (each plan measured is rewritten, traced, and run for a few steps;
            under XLA each is compiled too): once they have passed, no further
            plan is measured and the choice is made among those measured (the
            plan's `estimates.details["measure_stopped_s"]` says so). None for
            no limit.
        strategy: Deprecated name of `objective`.
        update_in_backward: Run each optimizer update inside the backward
            pass, freeing weight gradients as soon as they are used
            (docs/updates-in-backward.md): `"auto"` (the default: when the
            step does not fit as it is, the optimizer allows it and the model
            is not compiled by XLA, under which they lowered no peak in
            tfremat's benchmarks; left after the backward pass when the
            planner's lowest plan with them misses the budget), True, or False
            (updates after the backward pass, as Keras does). With `measure`,
            `"auto"` decides for each plan measured: the plans made for less
            than `budget_mb` after a step predicted to fit measured over it
            run their updates in the backward pass. Where it cannot be exact
            (`global_clipnorm`, `LossScaleOptimizer`, gradient accumulation, a
            custom `train_step`, a `tf.distribute` strategy) the plan says why
            in `update_note` and updates after the backward pass.
        pin_order: Pin the backward pass to the simulator's order
            (`Plan.pin_order`): each layer's weight gradients before the next
            layer's backward, and each weight's update after the kernels
            that read the weight in the backward pass. True, False, or
            `"auto"` (the default): pinned on a CPU, where the executor's
            inter-op threads otherwise race (pinned, peaks were steady from
            step to step and no higher on the keras.applications models
            measured; on one thread an unpinned plan saved almost nothing),
            and in the scope of a `MultiWorkerMirroredStrategy`, where
            nothing measures the plan (docs/scaling.md); not on a GPU, whose
            kernels run one at a time, nor for a step XLA compiles
            (`jit_compile=True`), which XLA orders itself; not when the plan
            would change nothing else and the step is predicted to fit
            unpinned. A pinned
            plan is planned and predicted with each unit's update right after
            its backward pass, where TensorFlow then runs it, beside the next
            unit's backward on a CPU's inter-op threads
            (`tfremat.simulation.updates_follow_units`, `updates_overlap`;
            docs/how-it-works.md, "Pinning the order"). On a subclassed
            model, the recomputed sublayer calls are pinned.
        **settings: Settings of the chosen planner (see `tfremat.planners`), e.g.
            `finetune_episodes=20, finetune_time_limit=300` for `planner="dqn"`.

    Inside the `scope()` of a `tf.distribute.MultiWorkerMirroredStrategy`,
    call it on every worker, as the rest of the training code: each worker
    traces its replica's step through `strategy.run` and plans, and every
    worker then applies the chief's plan, received through the strategy's
    collectives (planning is deterministic, but a DP's `time_limit` is wall
    time).

    Returns:
        A `Plan` carrying its `graph`; empty when the step already fits.

    Raises:
        TypeError, ValueError: a bad budget, planner, objective or offload.
        BudgetError: the budget is below the smallest feasible one; the message
            and `.min_budget_mb` say what that minimum is. With `measure`, it is
            the higher of two measurements of the plan that measures lowest,
            plus 5%, when no measured plan fits; also when the prediction says
            no plan fits, the plan of lowest predicted peak is measured first:
            returned if it fits after all, a minimum stated so if not.
        RuntimeError: `measure` in the scope of a `tf.distribute` strategy with
            several replicas, where a step cannot be measured.

    Example:

    >>> plan = tfremat.plan(model, budget_mb=6000, batch_size=64)
    >>> plan.estimates.peak_mb
    """
    objective = deprecated_strategy(strategy, objective)
    budget_mb = check_budget_mb(budget_mb)
    check_planner(planner, objective, offload, update_in_backward, pin_order)
    verbose = check_verbose(verbose)
    max_trials = check_count(max_trials, "max_trials")
    if measure_time_limit is not None:
        measure_time_limit = check_positive(measure_time_limit, "measure_time_limit",
                                            "seconds")
    if measure:
        require_measurable_scope("tfremat.plan(measure=True)")
    if graph is not None and unit_layers(model):
        units = [n.id for n in graph if n.class_name in UNIT_CLASSES]
        if units:
            warn(f"tfremat: the graph given for {model.name!r} holds its recompute, "
                 f"update or offload units ({', '.join(map(repr, units[:3]))}"
                 f"{', ...' if len(units) > 3 else ''}) as single layers, whose backward "
                 "pass holds all they recompute, so predicted peaks run high. Without "
                 "graph=, tfremat.plan plans the model it was rewritten from.")
    if offload == "auto":
        offload = bool(tf.config.list_physical_devices("GPU"))
    if planner in ("auto", "dqn"):
        settings = {**settings, "offload": bool(offload)}
    with progress(verbose) as track:
        if graph is None:
            traced = track(f"tracing a training step of {model.name}", 1) if track else None
            graph = extract(unwrapped(model, compiled=True), batch_size=batch_size,
                            sample=sample)
            if traced:
                traced(1)
        # True and False hold for every plan (True warns once where it cannot be
        # honoured). "auto" is decided for the lower of the budget asked for and
        # the one each plan is made for: when the step is predicted to fit but
        # measures over, the plans measured next are made for less, and the
        # updates may be what brings it down.
        asked = int(budget_mb * MIB)
        decided = (None if update_in_backward == "auto" else
                   choose_updates(model, graph, asked, update_in_backward))
        auto_pin = pin_order == "auto"
        pin_order = pinned(pin_order, model)

        def make(budget_bytes: int, objective: str = objective) -> Plan:
            updates, note = (choose_updates(model, graph, min(budget_bytes, asked), "auto")
                             if decided is None else decided)

            def made_with(updates: bool) -> Plan:
                return make_plan(graph, budget_bytes, planner=planner, objective=objective,
                                 time_limit=time_limit, verbose=verbose,
                                 update_in_backward=updates, pin_order=pin_order, **settings)

            try:
                made = made_with(updates)
            except BudgetError as with_updates:
                if not updates or decided is not None:
                    raise
                # "auto" chose them, yet their own workspace can raise a floor.
                made, note = _without_updates(made_with, with_updates,
                                              None if budget_bytes >= asked else budget_bytes)
            made.update_note = note
            return _unpinned_where_idle(graph, made, budget_bytes) if auto_pin else made

        def bare(like: Plan) -> Plan:
            return unplanned(graph, like)

        def fixed(like: Plan) -> list[Plan]:
            return fixed_plans(graph, like)

        try:
            try:
                result = make(asked)
            except BudgetError as e:
                if not measure:
                    raise
                result = measured_floor(model, e, make, batch_size=batch_size,
                                        sample=sample, unplanned=bare, fixed=fixed,
                                        time_limit=measure_time_limit)
            else:
                if measure:
                    result = measured_choice(model, result, make, batch_size=batch_size,
                                             sample=sample, max_trials=max_trials,
                                             unplanned=bare, fixed=fixed,
                                             time_limit=measure_time_limit, planner=planner)
        except BudgetError as e:
            if e.measured_plan is not None:
                e.measured_plan.graph = graph
            raise
    result = chief_plan(result, graph)
    result.graph = graph
    return result


def _unpinned_where_idle(graph: PlanGraph, plan: Plan, budget_bytes: int) -> Plan:
    """`plan` with its order free when the pin (`pin_order="auto"`) is all it
    changes and the step is predicted to fit `budget_bytes` without it: the
    pin is there to keep a plan's saving, and a step that fits as written is
    left as written. Otherwise `plan`."""
    if not plan.pin_order or plan.segments or plan.offloaded or plan.update_in_backward:
        return plan
    free = dataclasses.replace(plan, pin_order=False, estimates=None)
    estimate = simulate(graph, free)
    if estimate.peak_bytes > budget_bytes:
        return plan
    free.estimates = estimate.plan_estimate(note=plan.estimates.note if plan.estimates else "")
    return free


def _without_updates(made_with: Callable[[bool], Plan], with_updates: BudgetError,
                     below_budget: int | None) -> tuple[Plan, str]:
    """The plan with updates after the backward pass, when the planner's
    lowest plan with them in it (`with_updates`) missed the bytes it was made
    for: the budget, or `below_budget` for a plan `measured_choice` makes
    for less. Returns the plan and its `update_note`. When both miss, the
    error stating the lower minimum is raised, so that planning at that
    minimum succeeds."""
    try:
        made = made_with(False)
    except BudgetError as without:
        raise min(without, with_updates, key=lambda e: e.min_budget_bytes) from None
    missed = ("the budget" if below_budget is None else
              f"the {below_budget / MIB:.1f} MiB this plan was made for (less than the "
              "budget: plans for more measured too close to it or over it)")
    return made, (f"with updates in the backward pass this planner's lowest plan is "
                  f"predicted at {with_updates.min_budget_bytes / MIB:.1f} MiB, over {missed}")


#: How much the same plan's measured peak moves from one measurement to the next
#: (the order in which ready operations run varies): up to 2% measured on an idle
#: CPU, 4.7% while another process trains (a plan measured 81.7 MiB in one
#: epoch, 85.6 in the next).
MEASURED_SPREAD = 0.05

#: Steps measured per plan (after one untimed warm-up step); its measured peak
#: is their largest. With recomputation the executor's order varies more from
#: step to step: on the demo model one plan measured 209-252 MiB over 20 steps
#: (its high mode, 238 and over, in 8 of them), where two steps often read
#: only the low mode and the epochs then went over the budget.
TRIAL_STEPS = 5

#: Bytes held beside the model's step (`held_bytes`) that a trial's text names,
#: in MiB; fewer are a process's small tensors, not worth a word.
HELD_SHOWN_MB = 1.0

#: Budgets, as fractions of the budget, of the plans `measured_choice` may try
#: after the first, before its last resorts.
TRIAL_FRACTIONS = (0.9, 0.8, 0.7, 0.6, 0.5)

#: Budgets of the last resorts after the plan of lowest predicted peak, as
#: fractions of the way from that peak up to the predicted peak without a plan.
#: The prediction is not off by one ratio, so it can rank plans near the floor
#: wrong: on a GPT-style model the lowest plan was predicted at 113.9 MiB and
#: measured 151.3, while the plan for 140.0 MiB measured 130.3.
FLOOR_LADDER = (0.05, 0.1, 0.2)


def measured_choice(model: keras.Model, first: Plan, make: Callable[..., Plan], *,
                    batch_size: int | None = None, sample: Any = None,
                    max_trials: int = 3,
                    unplanned: Callable[[Plan], Plan] | None = None,
                    fixed: Callable[[Plan], list[Plan]] | None = None,
                    time_limit: float | None = MEASURE_TIME_LIMIT,
                    planner: str | None = None) -> Plan:
    """The plan of least predicted overhead whose measured peak fits the budget
    with room for its spread.

    A plan measured once may measure `MEASURED_SPREAD` higher in a later
    step, so a plan fits with room when its measured peak plus that spread is
    within the budget. `first` (planned for the budget) is measured first.
    While the last plan measured has no such room, the next one tried is the
    fastest plan made for `TRIAL_FRACTIONS` of the budget (or for the lowest
    peak) whose prediction fits with room once scaled by the last trial's
    measured-to-predicted ratio of the step, with the bytes that trial found
    held beside the model (`held_bytes`) added; at most `max_trials` plans
    so. When none has room, the last resorts are measured in turn until one
    has (the prediction that put the plans over the budget is not off by one
    ratio, so it may rank them wrong): the plan of lowest predicted peak,
    plans for budgets `FLOOR_LADDER` of the way from its peak up to the peak
    without a plan, and
    `fixed(first)` (plans the prediction does not rank: every unit recomputed
    on its own, sqrt(n) segments). Then
    `unplanned(first)` (the step without recomputation or offload):
    recomputation does not lower every measured peak (not where the peak is
    one convolution's backward scratch), and no plan is trained that measures
    above none. When the plan of least overhead with room measured more than
    `MEASURED_SPREAD` below its prediction, one plan of less overhead is
    measured too (see `_lighter`): the step without recomputation, or the
    plan for the room the measurement shows. Plans are measured by
    `PlanInstallation.measure_peak`, which leaves every variable as it was.
    The plan of least predicted overhead among those with room is chosen;
    when none has room, the one of lowest measured peak among those within
    the budget. The last resorts do not depend on the
    budget, so planning again for a BudgetError's minimum measures the plan
    that set it.

    Args:
        model: The compiled model.
        first: The plan made for the budget.
        make: `make(budget_bytes, objective=...)` plans for another budget.
        batch_size: Batch size, when shapes come from `model.inputs`.
        sample: One batch `(x, y)` or a `tf.data.Dataset`.
        max_trials: Most plans measured before the last resorts.
        unplanned: `unplanned(plan)` is `plan` without segments or offloads
            (same updates and order), measured when no plan has room (its
            prediction tops the ladder); None measures no such plan, nor the
            ladder.
        fixed: `fixed(plan)` are plans like `plan` whose segments do not
            come from the prediction (see `fixed_plans`); None tries none.
        time_limit: Seconds after which no further plan is measured (the
            first always is); the choice is then made among those measured,
            and the chosen plan's details (or the BudgetError) say so. None
            for no limit.
        planner: The planner the caller asked for, which a BudgetError names
            (`first.planner`, the one `auto` chose, when None).

    Returns:
        The chosen plan; its estimate details hold `"measured_peak_bytes"` and
        `"trials"` (predicted, measured and held bytes of each plan measured).

    Raises:
        BudgetError: no plan measured fits; plans that measured lowest are
            measured again until the lowest (by its higher measurement) has
            been measured twice, the minimum stated is its higher measurement
            plus `MEASURED_SPREAD`, and `.measured_plan` is that plan.
    """
    candidates, lowest = _candidates(first, make)
    return _choose(model, first, candidates, lowest, make, batch_size=batch_size,
                   sample=sample, max_trials=max_trials, unplanned=unplanned,
                   fixed=fixed, time_limit=time_limit,
                   planner=planner or first.planner)


def _choose(model: keras.Model, first: Plan, candidates: list[Plan], lowest: Plan,
            make: Callable[..., Plan], *, batch_size: int | None, sample: Any,
            max_trials: int, unplanned: Callable[[Plan], Plan] | None,
            fixed: Callable[[Plan], list[Plan]] | None,
            time_limit: float | None, planner: str) -> Plan:
    """`measured_choice` among `candidates` (`first` first), then its last
    resorts from `lowest` on."""
    budget = first.budget_bytes
    roomy = largest_with_room(budget)
    trials: list[tuple[Plan, int]] = []
    held: list[int] = []  # each trial's bytes held beside the model's step (`held_bytes`)
    measured_keys: set[str] = set()
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    stopped = False  # the time limit kept a plan from being measured

    def out_of_time() -> bool:
        nonlocal stopped
        stopped = stopped or bool(trials and deadline is not None
                                  and time.perf_counter() > deadline)
        return stopped

    def measure(plan: Plan) -> None:
        if not out_of_time():
            measured_keys.add(_key(plan))
            measured = _trial(model, plan, budget, batch_size, sample)
            trials.append((plan, measured.peak_bytes))
            held.append(held_bytes(measured, plan))

    def done() -> bool:
        return any(m <= roomy for _, m in trials) or out_of_time()

    plan: Plan | None = first
    while plan is not None and len(trials) < max(1, max_trials):
        measure(plan)
        if done():
            break
        limit = _predicted_limit(roomy, plan, trials[-1][1], held[-1])
        plan = next((p for p in candidates if p.peak_bytes <= limit
                     and _key(p) not in measured_keys), None)
    for resort in _resorts(lowest, first, make, unplanned, fixed):
        if done():
            break
        if _key(resort) not in measured_keys:
            measure(resort)
    if unplanned is not None and not done():
        bare = unplanned(first)
        if _key(bare) not in measured_keys:
            measure(bare)
    lighter = _lighter(trials, held, roomy, first, make, unplanned)
    if lighter is not None and _key(lighter) not in measured_keys:
        measure(lighter)
    # Nothing fits: the lowest of several noisy measurements is a lucky one, so
    # the plan of lowest measured peak is measured again until that plan has
    # been measured twice (its higher measurement counts).
    while not any(m <= budget for _, m in trials):
        plan, _, times = _best_effort(_by_plan(trials))
        if times > 1 or out_of_time():
            break
        measure(plan)
    return _conclude(trials, held, budget, planner, time_limit if stopped else None)


def held_bytes(measured: MeasuredPeak, plan: Plan) -> int:
    """Bytes that were in use on the device before `plan`'s measured step beyond
    what its graph counts as persistent (weights, optimizer slots, batch): what
    the process keeps there besides the model. On a CPU that includes the
    arrays a `tf.data` pipeline was made from (the demo's 12 MiB of images held
    16.0 MiB); the simulator predicts the model's step alone. 0 when the plan
    has no graph."""
    if plan.graph is None:
        return 0
    return max(0, measured.start_bytes - plan.graph.total_persistent_bytes)


def _predicted_limit(limit: float, plan: Plan, measured: int, held: int) -> float:
    """The largest predicted peak of a plan that would measure within `limit`,
    judged by `plan`'s trial (`measured`, with `held` bytes beside the model's
    step): the held bytes stay as they are, the step scales by its measured to
    predicted ratio."""
    return (limit - held) * max(plan.peak_bytes, 1) / max(measured - held, 1)


def _overhead(plan: Plan) -> float:
    return plan.estimates.overhead if plan.estimates else 0.0


def _lighter(trials: list[tuple[Plan, int]], held: list[int], roomy: float, first: Plan,
             make: Callable[..., Plan],
             unplanned: Callable[[Plan], Plan] | None) -> Plan | None:
    """A plan of less predicted overhead than the fastest plan measured with
    room, to measure once when that plan's step (the bytes `held` beside it
    left out) measured more than `MEASURED_SPREAD` below its prediction (the
    prediction is high for this model, so less recomputation may fit as well):
    the step without recomputation when it is predicted within the room the
    measurement shows, else the plan made for that room. None when there is
    no such plan."""
    with_room = [(p, m, h) for (p, m), h in zip(trials, held) if m <= roomy]
    if not with_room:
        return None
    plan, measured, beside = min(with_room, key=lambda t: _overhead(t[0]))
    if (_overhead(plan) <= 0
            or measured - beside > plan.peak_bytes * (1 - MEASURED_SPREAD)):
        return None
    room = int(_predicted_limit(roomy, plan, measured, beside))
    bare = unplanned(first) if unplanned is not None else None
    if bare is not None and bare.peak_bytes <= room:
        lighter = dataclasses.replace(bare, planner=first.planner)
        lighter.estimates = dataclasses.replace(bare.estimates, note=(
            "No recomputation or offload: the step measured within the budget, "
            "below its prediction."))
    else:
        try:
            lighter = make(room)
        except BudgetError:
            return None
    return lighter if _overhead(lighter) < _overhead(plan) else None


def _best_effort(plans: list[tuple[Plan, int, int]]) -> tuple[Plan, int, int]:
    """Of `_by_plan`'s `(plan, highest measured peak, times)` when none fits:
    the plan of least predicted overhead among those measured within
    `MEASURED_SPREAD` of the lowest, whose differences are the spread of one
    plan's measurements rather than a saving (under XLA on a CPU, sqrt(n)
    segments at +30.7% compute measured 132.6 MiB against 133.8 without a
    plan)."""
    lowest = min(high for _, high, _ in plans)
    near = [t for t in plans if t[1] <= lowest * (1 + MEASURED_SPREAD)]
    return min(near, key=lambda t: (_overhead(t[0]), t[1]))


def _by_plan(trials: list[tuple[Plan, int]]) -> list[tuple[Plan, int, int]]:
    """Each plan of `(plan, measured peak)` trials once (plans that rewrite
    alike are one), in the order first measured, with its highest measured
    peak and how often it was measured."""
    seen: dict[str, tuple[Plan, int, int]] = {}
    for p, m in trials:
        key = _key(p)
        first, high, times = seen.get(key, (p, 0, 0))
        seen[key] = (first, max(high, m), times + 1)
    return list(seen.values())


def _conclude(trials: list[tuple[Plan, int]], held: list[int], budget: int, planner: str,
              stopped: float | None = None) -> Plan:
    """The plan `measured_choice` chooses among `(plan, measured peak)` trials
    (see there; `held`: each one's `held_bytes`), its measurements recorded,
    or its BudgetError; `stopped`: the time limit that ended measuring, if one
    did."""
    roomy = largest_with_room(budget)
    keys = [_key(p) for p, _ in trials]
    record = [{"predicted_bytes": p.peak_bytes, "measured_bytes": m,
               "held_bytes": held[i], "overhead": _overhead(p),
               "unplanned": not (p.segments or p.offloaded), "planner": p.planner,
               "again": keys[i] in keys[:i]}
              for i, (p, m) in enumerate(trials)]
    plans = _by_plan(trials)
    fitting = [(p, high) for p, high, _ in plans if high <= budget]
    with_room = [(p, m) for p, m in fitting if m <= roomy]
    if with_room:
        chosen, measured = min(with_room, key=lambda t: _overhead(t[0]))
    elif fitting:
        chosen, measured = min(fitting, key=lambda t: t[1])
    else:
        chosen, measured, _ = _best_effort(plans)
    if chosen.estimates is not None:
        chosen.estimates = dataclasses.replace(chosen.estimates, details={
            **chosen.estimates.details, "measured_peak_bytes": measured, "trials": record,
            "planned_for_bytes": chosen.budget_bytes,
            **({"measure_stopped_s": stopped} if stopped is not None else {})})
    chosen.budget_bytes = budget
    if not fitting:
        how = (f"measured twice (the higher), plus {MEASURED_SPREAD:.0%}"
               if stopped is None else
               f"plus {MEASURED_SPREAD:.0%}; measuring stopped at its time limit of "
               f"{stopped:g} s (measure_time_limit), before every plan was tried")
        lowest = (f"the step without recomputation or offload, which no plan measured "
                  f"more than {MEASURED_SPREAD:.0%} below: no plan lowers this model's peak "
                  "at this batch size"
                  if not (chosen.segments or chosen.offloaded) else
                  f"the plan that measured lowest (or cost least compute among those "
                  f"within {MEASURED_SPREAD:.0%} of it): {_named(chosen)}, predicted "
                  f"{chosen.peak_bytes / MIB:.1f} MiB, measured {measured / MIB:.1f}")
        error = BudgetError(
            budget, math.ceil(measured * (1 + MEASURED_SPREAD)), planner,
            f"The minimum is {lowest}, {how}. "
            f"{len(trials)} measurement(s):\n"
            + "\n".join("  " + trial_text(r, "-> measured") for r in record),
            measured=True)
        error.measured_plan = chosen
        raise error
    return chosen


def _named(plan: Plan) -> str:
    """A plan in a few words: its planner, segments, offloads and compute."""
    parts = [f"{len(plan.segments)} segment(s)"] if plan.segments else []
    if plan.offloaded:
        parts.append(f"{len(plan.offloaded)} offload(s)")
    parts.append(f"+{_overhead(plan):.1%} compute")
    return f"{plan.planner} ({', '.join(parts)})"


def largest_with_room(budget: int) -> float:
    """The largest measured peak that fits `budget` with room for its spread."""
    return budget / (1 + MEASURED_SPREAD)


def trial_text(trial: dict[str, Any], arrow: str = "->") -> str:
    """One trial of a plan's estimate details (`"trials"`) in words."""
    name = ("without recomputation" if trial.get("unplanned") else
            "every unit recomputed on its own" if trial.get("planner") == "every-unit"
            else "")
    if trial.get("again"):  # named: two plans may be predicted alike
        kind = f"the same plan again ({name}), " if name else "the same plan again, "
    else:
        kind = f"{name}, " if name else ""
    beside = trial.get("held_bytes", 0) / MIB
    held = f" + {beside:.1f} MiB held beside the model" if beside >= HELD_SHOWN_MB else ""
    return (f"{kind}predicted {trial['predicted_bytes'] / MIB:.1f} MiB{held} {arrow} "
            f"{trial['measured_bytes'] / MIB:.1f} MiB")


def _resegmented(graph: PlanGraph, like: Plan, planner: str, segments: list[Segment],
                 note: str) -> Plan:
    """`like` with `segments` instead of its own and no offloads (its updates and
    order kept), labelled `planner`, predicted for `graph`."""
    plan = dataclasses.replace(like, planner=planner, segments=segments, offloaded=[],
                               estimates=None)
    plan.estimates = simulate(graph, plan).plan_estimate(note=note)
    return plan


def unplanned(graph: PlanGraph, like: Plan) -> Plan:
    """`like` without segments or offloads (its updates and order kept),
    predicted for `graph`: the step as it runs without recomputation."""
    return _resegmented(graph, like, "none", [],
                        "No recomputation or offload: no plan measured lower by more than its "
                        "spread.")


def every_unit_like(graph: PlanGraph, like: Plan) -> Plan | None:
    """`like` recomputing every unit on its own (the "every-unit" planner's
    segments), without offloads (its updates and order kept), predicted for
    `graph`; None when no node keeps tensors of its own for its backward pass,
    or when that plan is predicted at or above the step without one (on a
    conv-BN-ReLU CNN, every BatchNorm on its own: 37.7 MiB against 36.6 plain,
    measured 44 MiB: a trial that only costs time)."""
    segments = every_unit_segments(graph)
    if not segments:
        return None
    plan = _resegmented(graph, like, "every-unit", [Segment(s) for s in segments],
                        "Every unit recomputed on its own: a last resort when the plan "
                        "of lowest predicted peak measured over the budget.")
    if plan.peak_bytes >= unplanned(graph, like).peak_bytes:
        return None
    return plan


def sqrt_like(graph: PlanGraph, like: Plan) -> Plan | None:
    """`like` with Chen et al.'s sqrt(n) segments instead of its own, without
    offloads (its updates and order kept), predicted for `graph`; None when
    the graph has no cut for them.

    Those segments follow the graph's cuts, not the prediction, so they are
    worth a measurement where the prediction sees no plan lowering the peak:
    VGG19 (96 px, batch 16, SGD) on an AMD EPYC, 2 cores, predicted every plan
    at its plain peak (683.3 MiB: there the simulator keeps every weight
    gradient to the end of the backward pass), while the plain step measured
    645.6 MiB and sqrt(n) segments 461.6.
    """
    segments = chen_sqrt(graph).segments
    if not segments:
        return None
    return _resegmented(graph, like, "chen-sqrt", list(segments),
                        "Chen et al.'s sqrt(n) segments: a last resort when the plan of "
                        "lowest predicted peak measured over the budget.")


def fixed_plans(graph: PlanGraph, like: Plan) -> list[Plan]:
    """The last resorts of `measured_choice` whose segments do not come from
    the prediction: every unit on its own (`every_unit_like`), then sqrt(n)
    segments (`sqrt_like`), each when there is one."""
    return [p for p in (every_unit_like(graph, like), sqrt_like(graph, like))
            if p is not None]


def _trial(model: keras.Model, plan: Plan, budget: int, batch_size: int | None,
           sample: Any) -> MeasuredPeak:
    """The measured peak of `plan`: the largest of `TRIAL_STEPS` steps."""
    # XLA ignores device placement: offload runs without it (as the Planner does).
    jit = False if plan.offloaded and xla_compiled(model) else None
    measured = PlanInstallation(model, plan, jit_compile=jit).measure_peak(
        batch_size=batch_size, sample=sample, repeats=TRIAL_STEPS, return_details=True)
    logger.info("Measured a plan predicted at %.1f MiB: %.1f MiB, %.1f MiB of it held "
                "beside the model (budget %.1f MiB).", plan.peak_bytes / MIB,
                measured.peak_mb, held_bytes(measured, plan) / MIB, budget / MIB)
    return measured


def measured_floor(model: keras.Model, error: BudgetError, make: Callable[..., Plan], *,
                   batch_size: int | None = None, sample: Any = None,
                   unplanned: Callable[[Plan], Plan] | None = None,
                   fixed: Callable[[Plan], list[Plan]] | None = None,
                   time_limit: float | None = MEASURE_TIME_LIMIT) -> Plan:
    """Measures the plan of lowest predicted peak when its prediction is over budget.

    A predicted minimum is only as good as the prediction: a second run at a
    stated minimum must meet it, so with `measure=True` the minimum stated is
    measured too.

    Args:
        model: The compiled model.
        error: The planner's BudgetError for the budget (the prediction).
        make: `make(budget_bytes, objective=...)` plans for another budget.
        batch_size: Batch size, when shapes come from `model.inputs`.
        sample: One batch `(x, y)` or a `tf.data.Dataset`.
        unplanned: As for `measured_choice`.
        fixed: As for `measured_choice`: measured when the plan of lowest
            predicted peak measures over the budget.
        time_limit: As for `measured_choice`.

    Returns:
        That plan (or one of `fixed`'s, or the one without segments or offloads,
        when it measures lower), when it measures within the budget after all (its
        estimate details hold `"trials"`, as `measured_choice`'s).

    Raises:
        BudgetError: it measures over the budget; the minimum stated and
            `.measured_plan` are as `measured_choice` states them (`error`
            itself, without a `measured_plan`, when no plan of that peak can
            be made). A `Planner` then trains with `.measured_plan`, as it
            does when a plan predicted to fit measures over: whether `fit`
            goes on does not hang on the prediction (a new user's LSTM,
            predicted at 23 MiB and measured at 12.9, stopped `fit` over a
            budget of 12.7 where a CNN 14% over went on).
    """
    try:
        lowest = make(error.min_budget_bytes, objective="memory")
    except BudgetError:
        raise error from None
    lowest.budget_bytes = error.budget_bytes
    try:  # every budget below the floor would plan `lowest` again
        return _choose(model, lowest, [lowest], lowest, make, batch_size=batch_size,
                       sample=sample, max_trials=1, unplanned=unplanned,
                       fixed=fixed, time_limit=time_limit, planner=error.planner)
    except BudgetError as measured:
        refused = BudgetError(
            error.budget_bytes, measured.min_budget_bytes, error.planner,
            f"{error.detail} The plan of lowest predicted peak "
            f"({error.min_budget_bytes / MIB:.1f} MiB) and plans near it were measured. "
            f"{measured.detail}", measured=True)
        refused.measured_plan = measured.measured_plan
        raise refused from None


def _key(plan: Plan) -> str:
    """What a plan rewrites: plans with equal keys measure alike."""
    return repr((plan.segments, plan.offloaded, plan.update_in_backward, plan.pin_order))


def _candidates(first: Plan, make: Callable[..., Plan]) -> tuple[list[Plan], Plan]:
    """The plans `measured_choice` measures before its last resorts, and the
    plan of lowest predicted peak.

    Returns:
        `first`, then plans for `TRIAL_FRACTIONS` of its budget and the plan
        of lowest predicted peak, each once, least predicted overhead first;
        and that lowest plan (`make` at the floor its BudgetError states).
    """
    budget = first.budget_bytes
    plans = [first]
    for fraction in (*TRIAL_FRACTIONS, 0.0):  # 0: for the floor, if none is below it
        try:
            plans.append(make(int(budget * fraction)))
        except BudgetError as e:
            try:
                plans.append(make(e.min_budget_bytes, objective="memory"))
            except BudgetError:
                pass
            break
    lowest = min(plans, key=lambda p: p.peak_bytes)
    unique: dict[str, Plan] = {}
    for p in plans:
        unique.setdefault(_key(p), p)
    others = sorted((p for p in unique.values() if p is not first),
                    key=lambda p: (_overhead(p), -p.peak_bytes))
    return [first, *others], lowest


def _resorts(lowest: Plan, first: Plan, make: Callable[..., Plan],
             unplanned: Callable[[Plan], Plan] | None,
             fixed: Callable[[Plan], list[Plan]] | None) -> Iterator[Plan]:
    """The last resorts of `measured_choice`, in the order they are measured,
    each made when it is reached: `lowest`, plans for `FLOOR_LADDER` of the way
    from its predicted peak up to the peak without a plan (`unplanned`'s
    prediction), and `fixed(first)`."""
    yield lowest
    if unplanned is not None:
        top = unplanned(lowest).peak_bytes
        for fraction in FLOOR_LADDER:
            try:
                yield make(round(lowest.peak_bytes + fraction * (top - lowest.peak_bytes)))
            except BudgetError:
                continue
    if fixed is not None:
        yield from fixed(first)


def chief_plan(local: Plan, graph: PlanGraph) -> Plan:
    """The chief worker's plan, on every worker of a multi-worker strategy.

    Outside a multi-worker strategy's scope, `local` itself. Inside, the chief's
    plan is broadcast as JSON through the strategy's collectives (an all-reduce
    sum to which only the chief contributes), so all workers rewrite their
    replicas alike; a worker whose own plan differed logs a warning.

    Raises:
        PlanMismatchError: the chief planned another model (fingerprints differ).
    """
    if not multi_worker():
        return local
    strategy = tf.distribute.get_strategy()
    chief = strategy.extended.should_checkpoint
    text = local.to_json(indent=None)

    @tf.function
    def summed(values: tf.Tensor) -> tf.Tensor:
        return strategy.reduce(tf.distribute.ReduceOp.SUM,
                               strategy.run(tf.identity, args=(values,)), axis=None)

    mine = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    length = int(summed(tf.constant([len(mine) if chief else 0]))[0])
    received = summed(tf.constant(mine if chief else np.zeros(length, np.int32)))
    chosen_text = np.asarray(received, np.uint8).tobytes().decode()
    chosen = Plan.from_json(chosen_text).for_graph(graph)
    if chosen_text != text:
        logger.warning("tfremat: this worker's own plan differs from the chief's "
                       "(%d vs %d segments); using the chief's.",
                       len(local.segments), len(chosen.segments))
    return chosen


def rewrite(model: keras.Model, plan_or_none: Plan | None = None, *,
            budget_mb: float | None = None, batch_size: int | None = None,
            sample: Any = None, planner: str = "auto", objective: str = "time",
            compute_device: str | None = None, host_device: str | None = None,
            strategy: str | None = None,
            update_in_backward: bool | str = "auto",
            pin_order: bool | str = "auto", measure: bool = False,
            max_trials: int = 3,
            measure_time_limit: float | None = MEASURE_TIME_LIMIT) -> keras.Model:
    """Returns a model sharing `model`'s layers and weights whose step fits.

    Either pass a `Plan`, or a `budget_mb` (with `batch_size` or `sample`) to plan
    first. The original model is never modified, also when rewriting fails.
    A plan made here fits the budget as the simulator predicts it unless
    `measure=True`, which measures plans on the device first and returns one
    that measured within the budget (see `tfremat.plan`).

    Args:
        model: A built Keras model.
        plan_or_none: A Plan made for this model.
        budget_mb: Budget in MiB, to plan with `tfremat.plan` first.
        batch_size: Batch size for planning.
        sample: One batch or a dataset for planning.
        planner: Planner name for planning.
        objective: `"time"` or `"memory"` for planning.
        compute_device: Device of the step, for plans with host offload
            (default the first GPU).
        host_device: Device holding offloaded tensors (default `"/CPU:0"`).
        strategy: Deprecated name of `objective`.
        update_in_backward: For planning (see `tfremat.plan`). The rewritten
            model then updates with the optimizer it is compiled with.
        pin_order: For planning (see `tfremat.plan`).
        measure: For planning: measure candidate plans on the device and
            return one that measured within the budget (see `tfremat.plan`).
        max_trials: For planning with `measure` (see `tfremat.plan`).
        measure_time_limit: For planning with `measure` (see `tfremat.plan`).

    Returns:
        A new model sharing `model`'s layers and weights (uncompiled, for
        functional and Sequential models: compile it as you compiled `model`),
        also when the plan is empty (the step already fits; logged): it then
        recomputes nothing. Compiled with `jit_compile=True` (Keras's default
        with a GPU), it trains as the `Planner` runs a plan under XLA: each
        recompute segment compiles with XLA on its own and the step between
        them runs in TensorFlow's executor (compiled whole, XLA keeps less of
        the saving; docs/how-it-works.md, "XLA"). A plan with host offload
        needs `jit_compile=False`. Loaded from a `.keras` file, the model
        compiles its step whole under XLA: compile it with
        `jit_compile=False` and train it within
        `tfremat.rewriter.units_compiled()` for the same.

    Raises:
        BudgetError: planning found no plan within the budget (with
            `measure`, none that measured within it).

    Example:

    >>> smaller = tfremat.rewrite(model, budget_mb=6000, batch_size=64, measure=True)
    >>> smaller.compile(optimizer="adam", loss="mse"); smaller.fit(x, y)
    >>> loaded = keras.models.load_model("smaller.keras")
    >>> loaded.compile(optimizer="adam", loss="mse", jit_compile=False)
    >>> with tfremat.rewriter.units_compiled():   # XLA for each segment
    ...     loaded.fit(x, y)
    """
    objective = deprecated_strategy(strategy, objective)
    if plan_or_none is None:
        if budget_mb is None:
            raise ValueError("Pass a Plan, or budget_mb=... to plan first.")
        plan_or_none = plan(model, budget_mb, batch_size=batch_size, sample=sample,
                            planner=planner, objective=objective, measure=measure,
                            max_trials=max_trials, measure_time_limit=measure_time_limit,
                            update_in_backward=update_in_backward, pin_order=pin_order)
    elif not isinstance(plan_or_none, Plan):
        raise TypeError(f"rewrite takes a tfremat.Plan, not {type(plan_or_none).__name__}.")
    if plan_or_none.is_empty:
        # Still a new model: the caller compiles what it gets as the docs show,
        # which must not be the user's compiled (maybe trained) model.
        logger.info("The plan is empty (the step already fits): the rewritten model "
                    "recomputes nothing.")
    rewritten = rewrite_model(model, plan_or_none, compute_device=compute_device,
                              host_device=host_device)
    if compiles_segments(plan_or_none):
        train_units_compiled_under_xla(rewritten)
    return rewritten
