"""The planners by name, and `make_plan`, which picks one ("auto") or runs one."""

from __future__ import annotations

import warnings
from typing import Any, Callable

from tfremat.errors import BudgetError
from tfremat.graph.plan_graph import PlanGraph
from tfremat.planners import _segments as seg
from tfremat.planners.chen import chen_drop_cheap, chen_greedy, chen_recursive, chen_sqrt
from tfremat.planners.dp import STRATEGIES, DPTimeout, approx_dp, exact_dp
from tfremat.planners.plan import Plan
from tfremat.simulate import simulate

PLANNERS: dict[str, Callable[..., Plan]] = {
    "chen-sqrt": chen_sqrt,
    "chen-greedy": chen_greedy,
    "chen-drop-cheap": chen_drop_cheap,
    "chen-recursive": chen_recursive,
    "exact-dp": exact_dp,
    "approx-dp": approx_dp,
}

#: Graphs with at most this many nodes also get the exact DP under "auto".
EXACT_DP_MAX_NODES = 40


def make_plan(graph: PlanGraph, budget_bytes: int, planner: str = "auto",
              strategy: str = "time", time_limit: float | None = 60.0,
              verbose: int = 0, **settings: Any) -> Plan:
    """Plans recomputation for `graph` under a device budget.

    With `planner="auto"`: when the step already fits, an empty plan (no
    rewrite needed). Otherwise, first the approximate DP with `strategy` (and
    the exact DP on graphs of at most `EXACT_DP_MAX_NODES` nodes), Chen's
    greedy and sqrt(n) plans: the one that fits with the least extra compute
    wins. When none fits, the DPs with the other strategy and `chen-recursive`
    (nested segments reach below one level of segments), again the cheapest
    that fits.

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes, persistent bytes included.
        planner: `"auto"` or a key of `PLANNERS`.
        strategy: `"time"` (least overhead) or `"memory"` (memory-centric), for
            the DP planners.
        time_limit: Seconds for the exact DP; past it, `make_plan` warns and
            falls back to the approximate DP.
        verbose: 1 or more shows progress of the DP planners.
        **settings: Settings of the chosen planner (for "auto": of the
            approximate DP).

    Returns:
        A Plan that passes `plan.validate(graph)`, with `planner`, `settings`,
        `budget_bytes` and estimates `"peak_bytes"`, `"overhead"`,
        `"extra_compute"` from `simulate`.

    Raises:
        ValueError: unknown planner or strategy.
        BudgetError: the budget cannot be met; `min_budget_mb` is the smallest
            simulated peak among the planners tried.

    Example:

    >>> plan = make_plan(graph, budget_bytes=6000 * 2**20)
    >>> plan.estimates["peak_bytes"] <= 6000 * 2**20
    True
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of {STRATEGIES}.")
    if planner == "auto":
        return _auto(graph, budget_bytes, strategy, time_limit, verbose, settings)
    if planner not in PLANNERS:
        raise ValueError(f"Unknown planner {planner!r}; choose 'auto' or one of "
                         f"{sorted(PLANNERS)}.")
    if planner == "exact-dp":
        return _exact_or_approx(graph, budget_bytes, strategy, time_limit, verbose,
                                settings)
    if planner == "approx-dp":
        settings = {**settings, "strategy": strategy, "verbose": verbose}
    return PLANNERS[planner](graph, budget_bytes, **settings)


def min_feasible_budget(graph: PlanGraph, planner: str = "auto", **settings: Any) -> int:
    """The smallest budget in bytes the planner meets on `graph`.

    Args:
        graph: The PlanGraph.
        planner: `"auto"` or a key of `PLANNERS`.
        **settings: As for `make_plan`.

    Returns:
        The smallest simulated peak the planner reaches, in bytes.
    """
    try:
        plan = make_plan(graph, 0, planner, **settings)
    except BudgetError as err:
        return round(err.min_budget_mb * seg.MIB)
    return plan.estimates["peak_bytes"]


def _exact_or_approx(graph: PlanGraph, budget_bytes: int, strategy: str,
                     time_limit: float | None, verbose: int,
                     settings: dict[str, Any]) -> Plan:
    try:
        return exact_dp(graph, budget_bytes, strategy=strategy, time_limit=time_limit,
                        verbose=verbose, **settings)
    except DPTimeout as err:
        warnings.warn(f"{err} Falling back to the approximate DP.", stacklevel=3)
        steps = {k: v for k, v in settings.items() if k == "search_steps"}
        return approx_dp(graph, budget_bytes, strategy=strategy, verbose=verbose, **steps)


def _auto(graph: PlanGraph, budget_bytes: int, strategy: str, time_limit: float | None,
          verbose: int, settings: dict[str, Any]) -> Plan:
    est = simulate(graph)
    if est.peak_bytes <= budget_bytes:
        return Plan.from_segments(
            graph, [], planner="auto", budget_bytes=budget_bytes,
            settings={"strategy": strategy},
            estimates={**seg.estimates_of(est),
                       "note": "The step fits the budget without recomputation: "
                               "no rewrite needed."})
    other = "memory" if strategy == "time" else "time"

    def dp(name: str, s: str) -> tuple[str, Callable[[], Plan]]:
        if name == "approx-dp":
            return (f"approx-dp ({s})", lambda: approx_dp(
                graph, budget_bytes, strategy=s, verbose=verbose, **settings))
        return (f"exact-dp ({s})", lambda: exact_dp(
            graph, budget_bytes, strategy=s, time_limit=time_limit, verbose=verbose))

    small = len(graph) <= EXACT_DP_MAX_NODES
    # Phase 1: the cheapest plan among those aiming at little recomputation.
    first = [dp("approx-dp", strategy)] + ([dp("exact-dp", strategy)] if small else []) + [
        ("chen-greedy", lambda: chen_greedy(graph, budget_bytes)),
        ("chen-sqrt", lambda: chen_sqrt(graph, budget_bytes))]
    # Phase 2, when none fits: strategies that trade more compute for memory.
    second = [dp("approx-dp", other)] + ([dp("exact-dp", other)] if small else []) + [
        ("chen-recursive", lambda: chen_recursive(graph, budget_bytes))]
    minimum = est.peak_bytes
    tried: list[str] = []
    for phase in (first, second):
        fitting: list[Plan] = []
        for name, attempt in phase:
            try:
                fitting.append(attempt())
                tried.append(f"{name}: fits")
            except BudgetError as err:
                minimum = min(minimum, round(err.min_budget_mb * seg.MIB))
                tried.append(f"{name}: {err.min_budget_mb:.1f} MiB")
            except DPTimeout as err:
                warnings.warn(f"{err} Skipping it.", stacklevel=3)
                tried.append(f"{name}: timed out")
        if fitting:
            plan = min(fitting, key=lambda p: (p.estimates["overhead"],
                                               p.estimates["peak_bytes"]))
            plan.estimates["note"] = (f"Chosen by planner='auto' (least extra compute "
                                      f"among plans that fit) after: {'; '.join(tried)}.")
            return plan
    raise seg.budget_error(budget_bytes, minimum, "auto",
                           "Smallest peaks reached: " + "; ".join(tried) + ".")
