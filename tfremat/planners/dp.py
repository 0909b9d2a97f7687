"""Kusumoto et al. 2019, *A Graph Theoretic Framework of Recomputation Algorithms
for Memory-Efficient Backpropagation*: exact and approximate DP planners.

A DP chooses a sequence of lower sets L_1 < ... < L_k = V under the model of
`_dp_model` (Eq. (1) and (2)); each block V_i = L_i \\ L_{i-1} that drops anything
becomes a recompute segment (its cached boundary is the segment's outputs).
The simulator, not Eq. (2), decides whether a plan meets the budget, so the DP's
own budget is searched:

- time-centric: the least-overhead plan whose simulated peak fits. The DP budget
  is bisected between the lowest feasible Eq. (2) peak and the peak without
  recomputation, keeping every plan the simulator accepts.
- memory-centric (Sec. 4.4): the DP budget is the lowest feasible one and the
  overhead is maximised, giving coarse blocks that liveness analysis serves
  well.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from tfremat.graph.plan_graph import PlanGraph
from tfremat.planners import _dp_approx, _segments as seg
from tfremat.planners._dp_exact import Deadline, DPTimeout, ExactDP
from tfremat.planners._dp_model import DPModel, DPResult
from tfremat.planners._progress import progress
from tfremat.planners.plan import Plan

STRATEGIES = ("time", "memory")

__all__ = ["DPTimeout", "STRATEGIES", "approx_dp", "exact_dp"]

_Solver = Callable[[float, str], "DPResult | None"]


def exact_dp(graph: PlanGraph, budget_bytes: int, *, strategy: str = "time",
             time_limit: float | None = 60.0, search_steps: int = 8,
             verbose: int = 0) -> Plan:
    """Plans with the exact DP over all lower sets (Sec. 4.2).

    Exponential in the graph's width: fast on chains and graphs of a few dozen
    calls, hopeless on wide graphs, hence `time_limit`.

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes.
        strategy: `"time"` (least overhead) or `"memory"` (memory-centric).
        time_limit: Seconds for the whole search (None: no limit).
        search_steps: Bisection steps over the DP's own budget.
        verbose: 1 or more shows a `rich` progress display.

    Returns:
        The Plan, estimates from `simulate`.

    Raises:
        DPTimeout: the time limit passed.
        BudgetError: no plan found fits the budget; the minimum is the smallest
            simulated peak among the plans tried.
    """
    settings = {"strategy": strategy, "time_limit": time_limit,
                "search_steps": search_steps}
    model = DPModel.of(graph)
    deadline = Deadline(time_limit)
    with progress(verbose) as track:
        dp = ExactDP(model, deadline, track)
        return _plan(graph, model, dp.solve, budget_bytes, strategy, search_steps,
                     planner="exact-dp", settings=settings)


def approx_dp(graph: PlanGraph, budget_bytes: int, *, strategy: str = "time",
              buckets: int = 64, search_steps: int = 8, verbose: int = 0) -> Plan:
    """Plans with the approximate DP over ancestor closures L_v (Sec. 4.3).

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes.
        strategy: `"time"` (least overhead) or `"memory"` (memory-centric).
        buckets: Bands of cached bytes kept per key (more: closer to optimal,
            slower).
        search_steps: Bisection steps over the DP's own budget.
        verbose: 1 or more shows a `rich` progress display.

    Returns:
        The Plan, estimates from `simulate`.

    Raises:
        BudgetError: no plan found fits the budget; the minimum is the smallest
            simulated peak among the plans tried.
    """
    settings = {"strategy": strategy, "buckets": buckets, "search_steps": search_steps}
    model = DPModel.of(graph)
    tables = _dp_approx.PairTables(model)
    with progress(verbose) as track:
        advance = track("approximate DP", search_steps + 3) if track else None

        def solve(budget: float, objective: str) -> DPResult | None:
            if advance:
                advance(1)
            return _dp_approx.solve(model, tables, budget, objective, buckets)

        return _plan(graph, model, solve, budget_bytes, strategy, search_steps,
                     planner="approx-dp", settings=settings)


def _plan(graph: PlanGraph, model: DPModel, solve: _Solver, budget_bytes: int,
          strategy: str, search_steps: int, *, planner: str,
          settings: dict[str, Any]) -> Plan:
    """Searches the DP's budget for plans the simulator accepts."""
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of {STRATEGIES}.")
    plans: dict[tuple[int, ...], Plan] = {}

    def plan_of(result: DPResult, dp_budget: float) -> Plan:
        key = tuple(result.sequence)
        if key not in plans:
            blocks = seg.merge_shared_blocks(graph, model.blocks(result.sequence))
            blocks = seg.valid_segments(graph, blocks)
            plans[key] = seg.finish_plan(
                graph, blocks, planner=planner, budget_bytes=budget_bytes,
                settings=settings,
                extra={"model_peak_bytes": result.peak, "model_overhead": result.overhead,
                       "dp_budget_bytes": dp_budget})
        return plans[key]

    if strategy == "time":
        empty = seg.finish_plan(graph, [], planner=planner, budget_bytes=budget_bytes,
                                settings=settings)
        if seg.fits(empty, budget_bytes):
            return empty
    floor = solve(math.inf, "peak")
    assert floor is not None  # without a budget some sequence always exists
    lowest = plan_of(floor, floor.peak)
    if strategy == "memory":
        chosen = solve(floor.peak, "memory") or floor
        return seg.best_plan([plan_of(chosen, floor.peak), lowest], budget_bytes, planner,
                             "Memory-centric DP at the lowest feasible DP budget.")
    first = solve(floor.peak, "time") or floor
    if seg.fits(plan_of(first, floor.peak), budget_bytes) or seg.fits(lowest, budget_bytes):
        low, high = float(floor.peak), float(model.evaluate([model.full])[1])
        for _ in range(search_steps):
            if high - low <= 5e-3 * high:
                break
            middle = (low + high) / 2
            result = solve(middle, "time")
            if result is not None and seg.fits(plan_of(result, middle), budget_bytes):
                low = middle
            else:
                high = middle
    return seg.best_plan(list(plans.values()), budget_bytes, planner,
                         f"{len(plans)} DP plans were simulated.")
