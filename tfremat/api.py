"""One-call entry points: plan a model under a budget, and rewrite it.

Also the checks every public entry point makes at the door (budgets, planner
and objective names), so that a bad argument is reported where it was given.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfremat.core import MIB, Plan, PlanGraph
from tfremat.graph import extract
from tfremat.planners import OBJECTIVES, PLANNERS, make_plan, progress
from tfremat.rewriter import rewrite_model

logger = logging.getLogger("tfremat")


def check_budget_mb(budget_mb: Any, name: str = "budget_mb") -> float:
    """`budget_mb` as a float, or a clear error.

    Raises:
        TypeError: not a real number (a string, None, a bool).
        ValueError: not finite, or not positive.
    """
    if isinstance(budget_mb, bool) or not isinstance(budget_mb, numbers.Real):
        raise TypeError(f"{name} must be a number of MiB, got {budget_mb!r} "
                        f"({type(budget_mb).__name__}).")
    value = float(budget_mb)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of MiB, got {budget_mb!r}.")
    return value


def check_planner(planner: str, objective: str, offload: bool | str = "auto") -> None:
    """Raises ValueError for an unknown planner, objective or offload setting."""
    if planner != "auto" and planner not in PLANNERS:
        raise ValueError(f"Unknown planner {planner!r}; choose 'auto' or one of "
                         f"{sorted(PLANNERS)}.")
    if objective not in OBJECTIVES:
        raise ValueError(f"Unknown objective {objective!r}; choose one of {OBJECTIVES}.")
    if offload not in (True, False, "auto"):
        raise ValueError(f"offload must be True, False or 'auto', got {offload!r}.")


def deprecated_strategy(strategy: str | None, objective: str) -> str:
    """The objective, taking the deprecated `strategy=` keyword into account."""
    if strategy is None:
        return objective
    warnings.warn("tfremat: `strategy=` is now called `objective=` (\"time\" or "
                  "\"memory\"); `strategy=` will be removed.", DeprecationWarning,
                  stacklevel=3)
    return strategy


def plan(model: keras.Model, budget_mb: float, *, batch_size: int | None = None,
         sample: Any = None, planner: str = "auto", objective: str = "time",
         offload: bool | str = "auto", time_limit: float = 60.0, verbose: int = 0,
         graph: PlanGraph | None = None, strategy: str | None = None) -> Plan:
    """Plans what to recompute so one training step fits `budget_mb`.

    Args:
        model: A built Keras model (compiled models use their loss and optimizer).
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
            `"swap"`.
        objective: `"time"` (least recomputation under the budget) or `"memory"`
            (Kusumoto et al.'s memory-centric strategy) for the DP planners.
        offload: Let planner `"auto"` offload activations to host memory when
            recomputation alone cannot meet the budget: True, False, or `"auto"`
            (on when a GPU exists, so that there is a host to offload to).
        time_limit: Seconds the exact DP may take before falling back.
        verbose: 1 shows what planning is doing (tracing, the planners "auto"
            tries, the DPs' progress) once it has taken more than two seconds;
            2 shows it at once and leaves it on screen.
        graph: The model's PlanGraph, if already extracted.
        strategy: Deprecated name of `objective`.

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
            and `.min_budget_mb` say what that minimum is.

    Example:

    >>> plan = tfremat.plan(model, budget_mb=6000, batch_size=64)
    >>> plan.estimates.peak_mb
    """
    objective = deprecated_strategy(strategy, objective)
    budget_mb = check_budget_mb(budget_mb)
    check_planner(planner, objective, offload)
    if offload == "auto":
        offload = bool(tf.config.list_physical_devices("GPU"))
    settings = {"offload": bool(offload)} if planner == "auto" else {}
    with progress(verbose) as track:
        if graph is None:
            traced = track(f"tracing a training step of {model.name}", 1) if track else None
            graph = extract(model, batch_size=batch_size, sample=sample)
            if traced:
                traced(1)
        result = make_plan(graph, int(budget_mb * MIB), planner=planner,
                           objective=objective, time_limit=time_limit, verbose=verbose,
                           **settings)
    result = chief_plan(result, graph)
    result.graph = graph
    return result


def chief_plan(local: Plan, graph: PlanGraph) -> Plan:
    """The chief worker's plan, on every worker of a multi-worker strategy.

    Outside a multi-worker strategy's scope, `local` itself. Inside, the chief's
    plan is broadcast as JSON through the strategy's collectives (an all-reduce
    sum to which only the chief contributes), so all workers rewrite their
    replicas alike; a worker whose own plan differed logs a warning.

    Raises:
        PlanMismatchError: the chief planned another model (fingerprints differ).
    """
    if not tf.distribute.in_cross_replica_context():
        return local
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync == len(strategy.extended.worker_devices):
        return local  # one worker
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
    chosen = Plan.from_json(chosen_text)
    chosen.check_graph(graph)
    if chosen_text != text:
        logger.warning("tfremat: this worker's own plan differs from the chief's "
                       "(%d vs %d segments); using the chief's.",
                       len(local.segments), len(chosen.segments))
    return chosen


def rewrite(model: keras.Model, plan_or_none: Plan | None = None, *,
            budget_mb: float | None = None, batch_size: int | None = None,
            sample: Any = None, planner: str = "auto", objective: str = "time",
            compute_device: str | None = None, host_device: str | None = None,
            strategy: str | None = None) -> keras.Model:
    """Returns a model sharing `model`'s layers and weights whose step fits.

    Either pass a `Plan`, or a `budget_mb` (with `batch_size` or `sample`) to plan
    first. The original model is never modified, also when rewriting fails.

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

    Returns:
        The rewritten model, or `model` itself when the plan is empty (the
        step already fits; logged).

    Example:

    >>> smaller = tfremat.rewrite(model, budget_mb=6000, batch_size=64)
    >>> smaller.compile(optimizer="adam", loss="mse"); smaller.fit(x, y)
    """
    objective = deprecated_strategy(strategy, objective)
    if plan_or_none is None:
        if budget_mb is None:
            raise ValueError("Pass a Plan, or budget_mb=... to plan first.")
        plan_or_none = plan(model, budget_mb, batch_size=batch_size, sample=sample,
                            planner=planner, objective=objective)
    elif not isinstance(plan_or_none, Plan):
        raise TypeError(f"rewrite takes a tfremat.Plan, not {type(plan_or_none).__name__}.")
    if plan_or_none.is_empty:
        logger.info("The plan is empty (the step already fits): no rewrite.")
        return model
    return rewrite_model(model, plan_or_none, compute_device=compute_device,
                         host_device=host_device)
