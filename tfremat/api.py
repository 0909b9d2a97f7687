"""One-call entry points: plan a model under a budget, and rewrite it."""

from __future__ import annotations

import logging
from typing import Any

import keras
import tensorflow as tf

from tfremat.graph.extract import extract
from tfremat.graph.plan_graph import PlanGraph
from tfremat.planners.plan import Plan
from tfremat.planners.registry import make_plan
from tfremat.rewriter import rewrite_model

logger = logging.getLogger("tfremat")

MIB = 2**20


def plan(model: keras.Model, budget_mb: float, *, batch_size: int | None = None,
         sample: Any = None, planner: str = "auto", strategy: str = "time",
         offload: bool | str = "auto", time_limit: float = 60.0, verbose: int = 0,
         graph: PlanGraph | None = None) -> Plan:
    """Plans what to recompute so one training step fits `budget_mb`.

    Args:
        model: A built Keras model (compiled models use their loss and optimizer).
        budget_mb: Device memory budget in MiB (2**20 bytes) for the whole step,
            weights and optimizer state included, as
            `tf.config.experimental.get_memory_info(device)["peak"]` reports it.
        batch_size: Batch size, when shapes come from `model.inputs`.
        sample: One batch `(x, y)` or a `tf.data.Dataset`, instead of `batch_size`.
        planner: `"auto"` or one of `"chen-sqrt"`, `"chen-greedy"`,
            `"chen-drop-cheap"`, `"chen-recursive"`, `"exact-dp"`, `"approx-dp"`.
        strategy: `"time"` (least recomputation under the budget) or `"memory"`
            (Kusumoto et al.'s memory-centric strategy) for the DP planners.
        offload: Let planner `"auto"` offload activations to host memory when
            recomputation alone cannot meet the budget: True, False, or `"auto"`
            (on when a GPU exists, so that there is a host to offload to).
        time_limit: Seconds the exact DP may take before falling back.
        verbose: 1 to show progress of long searches.
        graph: The model's PlanGraph, if already extracted.

    Returns:
        A `Plan`; empty when the step already fits.

    Raises:
        BudgetError: the budget is below the smallest feasible one; the message
            and `.min_budget_mb` say what that minimum is.

    Example:

    >>> plan = tfremat.plan(model, budget_mb=6000, batch_size=64)
    >>> plan.estimates["peak_bytes"] / 2**20
    """
    if graph is None:
        graph = extract(model, batch_size=batch_size, sample=sample)
    if offload == "auto":
        offload = bool(tf.config.list_physical_devices("GPU"))
    settings = {"offload": bool(offload)} if planner == "auto" else {}
    result = make_plan(graph, int(budget_mb * MIB), planner=planner, strategy=strategy,
                       time_limit=time_limit, verbose=verbose, **settings)
    result.graph = graph
    return result


def rewrite(model: keras.Model, plan_or_none: Plan | None = None, *,
            budget_mb: float | None = None, batch_size: int | None = None,
            sample: Any = None, planner: str = "auto", strategy: str = "time",
            compute_device: str | None = None, host_device: str | None = None) -> keras.Model:
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
        strategy: `"time"` or `"memory"` for planning.
        compute_device: Device of the step, for plans with host offload
            (default the first GPU).
        host_device: Device holding offloaded tensors (default `"/CPU:0"`).

    Returns:
        The rewritten model, or `model` itself when the plan is empty (the
        step already fits; logged).

    Example:

    >>> smaller = tfremat.rewrite(model, budget_mb=6000, batch_size=64)
    >>> smaller.compile(optimizer="adam", loss="mse"); smaller.fit(x, y)
    """
    if plan_or_none is None:
        if budget_mb is None:
            raise ValueError("Pass a Plan, or budget_mb=... to plan first.")
        plan_or_none = plan(model, budget_mb, batch_size=batch_size, sample=sample,
                            planner=planner, strategy=strategy)
    if plan_or_none.is_empty:
        logger.info("The plan is empty (the step already fits): no rewrite.")
        return model
    return rewrite_model(model, plan_or_none, compute_device=compute_device,
                         host_device=host_device)
