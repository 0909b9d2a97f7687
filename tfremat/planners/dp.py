"""Kusumoto et al. 2019, *A Graph Theoretic Framework of Recomputation Algorithms
for Memory-Efficient Backpropagation*: exact and approximate DP planners.

A DP chooses a sequence of lower sets L_1 < ... < L_k = V under the model of
`_dp_model` (Eq. (1) and (2)); each block V_i = L_i \\ L_{i-1} that drops anything
becomes a recompute segment (its cached boundary is the segment's outputs).
The simulator, not Eq. (2), decides whether a plan meets the budget, so the DP's
own budget is searched:

- time-centric: the least-overhead plan whose simulated peak fits. The DP budget
  is searched between the lowest feasible Eq. (2) peak and the peak without
  recomputation (`_Search._search_dp_budget`), keeping every plan the
  simulator accepts. When no time-centric plan fits, the memory-centric ones
  below are tried, and the least-overhead one that fits wins.
- memory-centric (Sec. 4.4): the overhead is maximised at the lowest feasible
  DP budget, giving coarse blocks that liveness analysis serves well; as the
  simulator often rates slightly coarser blocks lower still, the DP budgets of
  `MEMORY_SCAN` are tried and the plan with the lowest simulated peak wins.
  When even that one misses the budget, `_refine.lower_peak` nests segments
  where the simulated peak occurs (Chen et al.'s recursion, only where it
  pays) until the plan fits or no move lowers the peak, starting from the
  `REFINE_STARTS` lowest plans in turn; such plans carry the estimate details
  `"refined": True` and `"flat_peak_bytes"`.

The lowest feasible Eq. (2) budget is found by a DP minimising the peak: exactly
by the exact DP, within its bands by the approximate DP (the least peak over its
keys can be lower; docs/how-it-works.md says why the search starts from the
banded one). `exact_dp`
also runs the approximate DP's search and returns the better of the two plans
under the simulator, so it is never worse than `approx_dp`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from tfremat.core import BudgetError, Plan, PlanGraph
from tfremat.planners import _dp_approx, _refine, toolkit as seg
from tfremat.planners._dp_exact import Deadline, DPTimeout, ExactDP
from tfremat.planners._dp_model import DPModel, DPResult
from tfremat.planners._progress import Track, progress

OBJECTIVES = ("time", "memory")

#: DP budgets of the memory-centric objective, as multiples of the lowest
#: feasible one: coarser blocks can simulate lower (liveness), so a few are tried.
MEMORY_SCAN = (1.0, 1.1, 1.25, 1.5, 2.0)

#: The time-centric search stops once a plan's simulated peak is within this
#: fraction below the budget: a fuller plan would save little more time.
FILL_TOLERANCE = 0.01

#: Plans of lowest simulated peak that the memory-centric search nests
#: (`_refine.lower_peak`) when none fits the budget, one after the other.
REFINE_STARTS = 2

#: Bands of cached bytes per key of the approximate DP (`approx_dp`'s `buckets`).
APPROX_BUCKETS = 64

__all__ = ["DPTimeout", "OBJECTIVES", "approx_dp", "exact_dp"]

_Solver = Callable[[float, str], "DPResult | None"]


def exact_dp(graph: PlanGraph, budget_bytes: int, *, objective: str = "time",
             time_limit: float | None = 60.0, search_steps: int = 8,
             verbose: int = 0) -> Plan:
    """Plans with the exact DP over all lower sets (Sec. 4.2).

    Exponential in the graph's width: fast on chains and graphs of a few dozen
    calls, hopeless on wide graphs, hence `time_limit`.

    The exact DP is optimal for Eq. (2), not for the simulator, which rates
    plans by liveness: the approximate DP's coarser plans can simulate lower.
    So the approximate DP's search (as `approx_dp` runs it) is run as well, and
    the better of the two plans is returned: for `"time"`, the one of least
    overhead among those that fit; for `"memory"`, the one of lowest simulated
    peak. The result is never worse than `approx_dp`'s by that measure, and its
    minimum feasible budget never higher. Its estimate details say which DP
    found it (`"dp"`: `"exact"` or `"approx"`).

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes.
        objective: `"time"` (least overhead within budget) or `"memory"`
            (memory-centric: the lowest simulated peak, nesting segments
            where the peak occurs when flat blocks miss the budget).
        time_limit: Seconds for the exact DP's search (None: no limit); the
            approximate DP's search, run once the exact one has finished, is
            not limited.
        search_steps: Most DP runs of the time-centric search over the DP's
            own budget.
        verbose: 1 or more shows a `rich` progress display.

    Returns:
        The Plan, estimates from `simulate`.

    Raises:
        DPTimeout: the time limit passed.
        BudgetError: no plan found fits the budget; the minimum is the smallest
            simulated peak among the plans tried by either DP.
    """
    settings = {"objective": objective, "time_limit": time_limit,
                "search_steps": search_steps}
    model = DPModel.of(graph)
    deadline = Deadline(time_limit)
    with progress(verbose) as track:
        dp = ExactDP(model, deadline, track)
        outcomes = {
            "exact": _outcome(lambda: _plan(
                graph, model, dp.solve, budget_bytes, objective, search_steps,
                planner="exact-dp", settings=settings)),
            "approx": _outcome(lambda: _approx_plan(
                graph, model, budget_bytes, objective, APPROX_BUCKETS, search_steps,
                track, planner="exact-dp", settings=settings))}
    plans = {dp_name: p for dp_name, p in outcomes.items() if isinstance(p, Plan)}
    if not plans:
        errors = [e for e in outcomes.values() if isinstance(e, BudgetError)]
        lowest = min(errors, key=lambda e: e.min_budget_bytes)
        raise BudgetError(budget_bytes, lowest.min_budget_bytes, "exact-dp",
                          " ".join(f"{name} DP: {e.detail}"
                                   for name, e in zip(outcomes, errors)))
    rank = seg.cost if objective == "time" else _lowest_peak_first
    dp_name, best = min(plans.items(), key=lambda item: rank(item[1]))
    best.estimates = dataclasses.replace(
        best.estimates, details={**best.estimates.details, "dp": dp_name})
    return best


def approx_dp(graph: PlanGraph, budget_bytes: int, *, objective: str = "time",
              buckets: int = APPROX_BUCKETS, search_steps: int = 8,
              verbose: int = 0) -> Plan:
    """Plans with the approximate DP over ancestor closures L_v (Sec. 4.3).

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes.
        objective: `"time"` (least overhead within budget) or `"memory"`
            (memory-centric: the lowest simulated peak, nesting segments
            where the peak occurs when flat blocks miss the budget).
        buckets: Bands of cached bytes kept per key (more: closer to optimal,
            slower). They cover only the cached bytes from which the budget
            can still be met, so they grow finer as the budget falls.
        search_steps: Most DP runs of the time-centric search over the DP's
            own budget.
        verbose: 1 or more shows a `rich` progress display.

    Returns:
        The Plan, estimates from `simulate`.

    Raises:
        BudgetError: no plan found fits the budget; the minimum is the smallest
            simulated peak among the plans tried.
    """
    settings = {"objective": objective, "buckets": buckets, "search_steps": search_steps}
    with progress(verbose) as track:
        return _approx_plan(graph, DPModel.of(graph), budget_bytes, objective, buckets,
                            search_steps, track, planner="approx-dp", settings=settings)


def _approx_plan(graph: PlanGraph, model: DPModel, budget_bytes: int, objective: str,
                 buckets: int, search_steps: int, track: Track | None, *, planner: str,
                 settings: dict[str, Any]) -> Plan:
    """The approximate DP's search, its plans recorded as `planner`'s."""
    tables = _dp_approx.PairTables(model)
    total = 2 + max(search_steps, len(MEMORY_SCAN))
    advance = track("approximate DP", total) if track else None

    def solve(budget: float, objective: str) -> DPResult | None:
        if advance:
            advance(1)
        return _dp_approx.solve(model, tables, budget, objective, buckets)

    return _plan(graph, model, solve, budget_bytes, objective, search_steps,
                 planner=planner, settings=settings)


def _outcome(search: Callable[[], Plan]) -> Plan | BudgetError:
    """The plan `search` returns, or the BudgetError it raises."""
    try:
        return search()
    except BudgetError as err:
        return err


def _lowest_peak_first(plan: Plan) -> tuple[int, float]:
    """How memory-centric plans are ranked: smallest peak, then least overhead."""
    return (plan.peak_bytes, plan.estimates.overhead)


def _plan(graph: PlanGraph, model: DPModel, solve: _Solver, budget_bytes: int,
          objective: str, search_steps: int, *, planner: str,
          settings: dict[str, Any]) -> Plan:
    """Searches the DP's budget for plans the simulator accepts."""
    if objective not in OBJECTIVES:
        raise ValueError(f"Unknown objective {objective!r}; choose one of {OBJECTIVES}.")
    search = _Search(graph, model, solve, budget_bytes, planner, settings)
    if objective == "memory":
        return search.memory_centric()
    return search.time_centric(search_steps)


class _Search:
    """DP runs at several DP budgets, each turned into a simulated Plan."""

    def __init__(self, graph: PlanGraph, model: DPModel, solve: _Solver,
                 budget_bytes: int, planner: str, settings: dict[str, Any]) -> None:
        self.graph, self.model, self.solve = graph, model, solve
        self.budget_bytes, self.planner, self.settings = budget_bytes, planner, settings
        self.plans: dict[tuple[int, ...], Plan] = {}

    def plan_of(self, result: DPResult, dp_budget: float) -> Plan:
        """The simulated Plan of a lower-set sequence (cached)."""
        key = tuple(result.sequence)
        if key not in self.plans:
            blocks = seg.merge_shared_blocks(self.graph, self.model.blocks(result.sequence))
            self.plans[key] = seg.finish_plan(
                self.graph, seg.valid_segments(self.graph, blocks), planner=self.planner,
                budget_bytes=self.budget_bytes, settings=self.settings,
                details={"model_peak_bytes": result.peak, "model_overhead": result.overhead,
                         "dp_budget_bytes": dp_budget})
        return self.plans[key]

    def floor(self) -> DPResult:
        """The sequence of least Eq. (2) peak (it always exists: [V] is one)."""
        result = self.solve(math.inf, "peak")
        assert result is not None
        self.plan_of(result, result.peak)
        return result

    def memory_scan(self, floor: DPResult) -> None:
        """Memory-centric DP plans at the DP budgets of `MEMORY_SCAN`."""
        for factor in MEMORY_SCAN:
            result = self.solve(floor.peak * factor, "memory")
            if result is not None:
                self.plan_of(result, floor.peak * factor)

    def lowest_or_refined(self) -> Plan:
        """The plan of lowest simulated peak; nested where its peak occurs when
        it misses the budget.

        The nesting is a local search, and where it ends depends on where it
        starts: the `REFINE_STARTS` lowest distinct plans are refined in turn
        until one fits.

        Raises:
            BudgetError: no refined plan meets the budget; the minimum is the
                lowest peak reached.
        """
        ranked = sorted({repr(p.segments): p for p in self.plans.values()}.values(),
                        key=_lowest_peak_first)
        lowest = ranked[0]
        if seg.fits(lowest, self.budget_bytes):
            return lowest
        for start in ranked[:REFINE_STARTS]:
            refined = _refine.lower_peak(self.graph, start.segments, self.budget_bytes)
            if refined == start.segments:
                continue
            plan = seg.finish_plan(self.graph, refined, planner=self.planner,
                                   budget_bytes=self.budget_bytes, settings=self.settings,
                                   details={"refined": True,
                                            "flat_peak_bytes": start.peak_bytes})
            if seg.fits(plan, self.budget_bytes):
                return plan
            lowest = min(lowest, plan, key=_lowest_peak_first)
        raise BudgetError(self.budget_bytes, lowest.peak_bytes, self.planner,
                               f"Memory-centric DP at {len(MEMORY_SCAN)} DP budgets, "
                               f"then nested where the peak occurs, from the "
                               f"{REFINE_STARTS} lowest plans.")

    def memory_centric(self) -> Plan:
        self.memory_scan(self.floor())
        return self.lowest_or_refined()

    def time_centric(self, search_steps: int) -> Plan:
        empty = seg.finish_plan(self.graph, [], planner=self.planner,
                                budget_bytes=self.budget_bytes, settings=self.settings)
        if seg.fits(empty, self.budget_bytes):
            return empty
        floor = self.floor()
        result = self.solve(floor.peak, "time") or floor
        first = self.plan_of(result, floor.peak)
        if seg.fits(first, self.budget_bytes):
            # Eq. (2) and the simulator disagree by a factor that drifts slowly
            # with the DP budget; the first guess assumes it stays put.
            guess = self.budget_bytes * result.peak / first.peak_bytes
            high = float(self.model.evaluate([self.model.full])[1])
            self._search_dp_budget(float(floor.peak), first.peak_bytes,
                                   high, empty.peak_bytes, guess,
                                   search_steps)
        elif not any(seg.fits(p, self.budget_bytes) for p in self.plans.values()):
            # Fine blocks simulate worse than Eq. (2) rates them; coarse ones can fit.
            self.memory_scan(floor)
            if not any(seg.fits(p, self.budget_bytes) for p in self.plans.values()):
                return self.lowest_or_refined()
        return seg.best_plan(list(self.plans.values()), self.budget_bytes, self.planner,
                             f"{len(self.plans)} DP plans were simulated.")

    def _search_dp_budget(self, low: float, low_peak: int, high: float, high_peak: int,
                          guess: float | None, steps: int) -> None:
        """Searches the largest DP budget whose plan's simulated peak fits.

        The first DP budget tried is `guess`. The simulated peak grows with the
        DP budget, so the next ones are interpolated between the bracket's ends
        (the Illinois variant of regula falsi); a step that fails to halve the
        bracket is followed by a bisection. The search stops once a plan fills
        the budget to within `FILL_TOLERANCE`, or the bracket is below 0.5% of
        its top.
        """
        budget = float(self.budget_bytes)
        f_low, f_high = low_peak - budget, high_peak - budget
        side, bisect = 0, False
        for _ in range(steps):
            best_fill = max((p.peak_bytes for p in self.plans.values()
                             if seg.fits(p, self.budget_bytes)), default=0)
            if best_fill >= (1 - FILL_TOLERANCE) * budget or high - low <= 5e-3 * high:
                return
            width = high - low
            if guess is not None:
                middle, guess = guess, None
            elif bisect or f_high <= f_low:
                middle = (low + high) / 2
            else:
                middle = low - f_low * width / (f_high - f_low)
            middle = min(max(middle, low + 0.05 * width), high - 0.05 * width)
            result = self.solve(middle, "time")
            peak = (self.plan_of(result, middle).peak_bytes
                    if result is not None else math.inf)
            if peak <= budget:
                low, f_low = middle, peak - budget
                if side == -1:
                    f_high /= 2
                side = -1
            else:
                high, f_high = middle, min(peak, high_peak) - budget
                if side == 1:
                    f_low /= 2
                side = 1
            bisect = high - low > width / 2
