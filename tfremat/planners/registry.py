"""The planners by name, and `make_plan`, which picks one ("auto") or runs one."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

from tfremat.core import (BudgetError, Node, Plan, PlanGraph, budget_unit_hint, warn,
                          with_pinned_order, with_updates_in_backward)
from tfremat.planners import toolkit as seg
from tfremat.planners._progress import progress
from tfremat.planners.chen import chen_drop_cheap, chen_greedy, chen_recursive, chen_sqrt
from tfremat.planners.deepq import dqn
from tfremat.planners.dp import OBJECTIVES, DPTimeout, approx_dp, exact_dp
from tfremat.planners.per_unit import every_unit
from tfremat.planners.swapping import swap, swap_combined
from tfremat.simulation import simulate

PLANNERS: dict[str, Callable[..., Plan]] = {
    "chen-sqrt": chen_sqrt,
    "chen-greedy": chen_greedy,
    "chen-drop-cheap": chen_drop_cheap,
    "chen-recursive": chen_recursive,
    "exact-dp": exact_dp,
    "approx-dp": approx_dp,
    "swap": swap,
    "dqn": dqn,
    "every-unit": every_unit,
}

#: Graphs with at most this many nodes also get the exact DP under "auto".
EXACT_DP_MAX_NODES = 40

#: Settings of "auto" meant for the swap planner rather than the approximate DP.
SWAP_SETTINGS = ("bandwidth_gbps", "device_flops", "host_budget_bytes", "min_bytes",
                 "prefetch_slack", "trials")

#: Recompute plans "auto" offloads on top of: budgets as fractions of the way
#: from the lowest recompute peak up to the peak without a plan.
OFFLOAD_LADDER = (0.0, 0.25, 0.5)


def make_plan(graph: PlanGraph, budget_bytes: int, planner: str = "auto",
              objective: str = "time", time_limit: float | None = 60.0,
              verbose: int = 0, offload: bool = True, update_in_backward: bool = False,
              pin_order: bool = False,
              **settings: Any) -> Plan:
    """Plans recomputation (and host offload) for `graph` under a device budget.

    With `planner="auto"`: when the step already fits, an empty plan (no
    rewrite needed). Otherwise, first the approximate DP with `objective` (and
    the exact DP on graphs of at most `EXACT_DP_MAX_NODES` nodes), Chen's
    greedy and sqrt(n) plans: the one that fits with the least extra compute
    wins. When none fits, `chen-recursive` (nested segments reach below one
    level of segments), every unit on its own (`every_unit`: the DPs' cost
    model can miss it, e.g. on a Transformer block where each layer keeps
    tensors of its own) and, for `objective="memory"`, the time-centric DPs,
    again the cheapest that fits (a time-centric DP that misses has already
    tried the memory-centric plans). When none fits and `offload` is on, the
    last step offloads activations to host memory on top of recompute plans
    at the budgets of `OFFLOAD_LADDER` and on top of no plan, keeping the
    cheapest plan that fits (`swap.swap_combined`).

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes, persistent bytes included.
        planner: `"auto"` or a key of `PLANNERS`.
        objective: `"time"` (least overhead) or `"memory"` (memory-centric), for
            the DP planners.
        time_limit: Seconds for the exact DP; past it, `make_plan` warns and
            falls back to the approximate DP.
        verbose: 1 or more shows progress of the DP planners.
        offload: Whether "auto" may offload to host memory when recomputation
            alone cannot meet the budget, and whether "dqn" may swap out.
        update_in_backward: Plan for optimizer updates inside the backward
            pass (`Plan.update_in_backward`): every plan is simulated with each
            weight gradient freed by its update, so the planners reach the
            lower floor. The plan returned carries the setting.
        pin_order: Plan for a pinned backward order (`Plan.pin_order`):
            every plan is simulated with the updates it times
            (`tfremat.simulation.updates_follow_units`). The plan returned
            carries the setting.
        **settings: Settings of the chosen planner (for "auto": those named in
            `SWAP_SETTINGS` go to the swap planner, the others to the
            approximate DP).

    Returns:
        A Plan that passes `plan.validate(graph)`, with `planner`, `settings`,
        `budget_bytes` and a `PlanEstimate` from `simulate`.

    Raises:
        ValueError: unknown planner or objective.
        BudgetError: the budget cannot be met; `min_budget_bytes` is the smallest
            simulated peak among the planners tried.

    Example:

    >>> plan = make_plan(graph, budget_bytes=6000 * 2**20)
    >>> plan.peak_bytes <= 6000 * 2**20
    True
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"Unknown objective {objective!r}; choose one of {OBJECTIVES}.")
    if planner != "auto" and planner not in PLANNERS:
        raise ValueError(f"Unknown planner {planner!r}; choose 'auto' or one of "
                         f"{sorted(PLANNERS)}.")
    # Plans made for the marked graph run their updates in the backward pass
    # and pin the order as asked.
    marked = with_pinned_order(with_updates_in_backward(graph, update_in_backward), pin_order)
    try:
        if planner == "auto":
            plan = _auto(marked, budget_bytes, objective, time_limit, verbose, offload,
                         settings)
        elif planner == "exact-dp":
            plan = _exact_or_approx(marked, budget_bytes, objective, time_limit, verbose,
                                    settings)
        else:
            if planner == "approx-dp":
                settings = {**settings, "objective": objective, "verbose": verbose}
            if planner == "dqn":
                settings = {**settings, "offload": offload}
            plan = PLANNERS[planner](marked, budget_bytes, **settings)
    except BudgetError as err:
        detail = " ".join(t for t in (err.detail, _floor_note(graph, err.min_budget_bytes),
                                      _shared_note(graph)) if t)
        raise BudgetError(err.budget_bytes, err.min_budget_bytes, err.planner, detail,
                          err.measured) from None
    plan.graph = graph  # for plan.summary() and plan.to_pydot()
    return plan


def min_feasible_budget(graph: PlanGraph, planner: str = "auto", **settings: Any) -> int:
    """The smallest budget in bytes the planner meets on `graph`.

    The same figure a `BudgetError` of `make_plan` with the same settings
    carries as `min_budget_bytes`, without having to provoke one.
    `"chen-sqrt"` answers at once; `"auto"` runs every planner it would try
    (with host offload unless `offload=False`), which can take as long as
    planning. `tfremat.plan` plans with the optimizer's updates in the
    backward pass and a pinned order where they lower the peak: pass
    `update_in_backward=True, pin_order=True` for its figure.

    Args:
        graph: The PlanGraph.
        planner: `"auto"` or a key of `PLANNERS`.
        **settings: As for `make_plan`.

    Returns:
        The smallest simulated peak the planner reaches, in bytes.

    Example:

    >>> from tfremat.planners import min_feasible_budget
    >>> graph = tfremat.extract(model, batch_size=16)
    >>> lowest = min_feasible_budget(graph, "chen-sqrt")
    >>> plan = tfremat.plan(model, budget_mb=lowest / 2**20, graph=graph,
    ...                     planner="chen-sqrt")
    """
    try:
        plan = make_plan(graph, 0, planner, **settings)
    except BudgetError as err:
        return err.min_budget_bytes
    return plan.peak_bytes


def _exact_or_approx(graph: PlanGraph, budget_bytes: int, objective: str,
                     time_limit: float | None, verbose: int,
                     settings: dict[str, Any]) -> Plan:
    try:
        return exact_dp(graph, budget_bytes, objective=objective, time_limit=time_limit,
                        verbose=verbose, **settings)
    except DPTimeout as err:
        warn(f"{err} Falling back to the approximate DP.")
        steps = {k: v for k, v in settings.items() if k == "search_steps"}
        return approx_dp(graph, budget_bytes, objective=objective, verbose=verbose, **steps)


def _auto(graph: PlanGraph, budget_bytes: int, objective: str, time_limit: float | None,
          verbose: int, offload: bool, settings: dict[str, Any]) -> Plan:
    swap_settings = {k: v for k, v in settings.items() if k in SWAP_SETTINGS}
    settings = {k: v for k, v in settings.items() if k not in SWAP_SETTINGS}
    est = simulate(graph)
    if est.peak_bytes <= budget_bytes:
        return Plan.from_segments(
            graph, [], planner="auto", budget_bytes=budget_bytes,
            settings={"objective": objective},
            estimates=est.plan_estimate(note="The step fits the budget without "
                                             "recomputation: no rewrite needed"
                                             + budget_unit_hint(budget_bytes) + "."))
    other = "memory" if objective == "time" else "time"

    def dp(name: str, s: str) -> tuple[str, Callable[[int], Plan]]:
        if name == "approx-dp":
            return (f"approx-dp ({s})", lambda b: approx_dp(
                graph, b, objective=s, verbose=verbose, **settings))
        return (f"exact-dp ({s})", lambda b: exact_dp(
            graph, b, objective=s, time_limit=time_limit, verbose=verbose))

    small = len(graph) <= EXACT_DP_MAX_NODES
    # Phase 1: the cheapest plan among those aiming at little recomputation.
    first = [dp("approx-dp", objective)] + ([dp("exact-dp", objective)] if small else []) + [
        ("chen-greedy", lambda b: chen_greedy(graph, b)),
        ("chen-sqrt", lambda b: chen_sqrt(graph, b))]
    # Phase 2, when none fits: strategies that trade more compute for memory. A
    # time-centric DP that misses has tried the memory-centric plans already.
    second = (([dp("approx-dp", other)] + ([dp("exact-dp", other)] if small else []))
              if objective == "memory" else []) + [
        ("chen-recursive", lambda b: chen_recursive(graph, b)),
        ("every-unit", lambda b: every_unit(graph, b))]
    minimum = est.peak_bytes
    tried: list[str] = []
    answered: list[Callable[[int], Plan]] = []  # attempts that did not time out
    with progress(verbose) as track:
        stage = track("planner auto", len(first) + len(second)) if track else None
        for phase in (first, second):
            fitting: list[Plan] = []
            for name, attempt in phase:
                if stage:
                    stage(0, description=f"planner auto: trying {name}")
                try:
                    fitting.append(attempt(budget_bytes))
                    tried.append(f"{name}: fits")
                except BudgetError as err:
                    minimum = min(minimum, err.min_budget_bytes)
                    tried.append(f"{name}: {err.feasible_mb:.1f} MiB")
                    answered.append(attempt)
                except DPTimeout as err:
                    warn(f"{err} Skipping it.")
                    tried.append(f"{name}: timed out")
                if stage:
                    stage(1)
            if fitting:
                plan = min(fitting, key=seg.cost)
                return _noted(plan, f"Chosen by planner='auto' (least extra compute among "
                                    f"plans that fit) after: {'; '.join(tried)}.")
    if offload:
        bases = _recompute_bases(answered, minimum, est.peak_bytes)
        try:
            plan = swap_combined(graph, budget_bytes, bases, **swap_settings)
        except BudgetError as err:
            minimum = min(minimum, err.min_budget_bytes)
            tried.append(f"offloading on top of them: {err.feasible_mb:.1f} MiB")
        else:
            return _noted(plan, f"Chosen by planner='auto' after: {'; '.join(tried)}; "
                                "offloading to host memory (on top of recomputation "
                                "when cheaper) meets the budget.")
    raise BudgetError(budget_bytes, minimum, "auto",
                      "Smallest budget each meets, as predicted: " + "; ".join(tried) + ".")


#: A layer call whose own workspace is at least this fraction of the minimum
#: budget is named in a `BudgetError`: no plan lowers it.
WORKSPACE_NOTE_FRACTION = 0.25


def _own_workspaces(node: Node) -> tuple[int, int]:
    """`node`'s forward and backward workspaces, without another call's kernel
    running beside its backward (`Node.backward_carried_bytes`), which a
    pinned order does away with."""
    return (node.forward_workspace_bytes,
            node.backward_workspace_bytes - node.backward_carried_bytes)


def _floor_note(graph: PlanGraph, minimum: int) -> str:
    """What holds up the smallest feasible budget `minimum` of `graph`: the
    persistent bytes and, when it weighs, the largest workspace of one call."""
    note = (f"Every plan keeps the {graph.total_persistent_bytes / 2**20:,.1f} MiB of "
            "weights, optimizer slots and batch.")
    node = max(graph.nodes, key=lambda n: max(_own_workspaces(n)))
    workspace = max(_own_workspaces(node))
    if workspace < WORKSPACE_NOTE_FRACTION * minimum:
        return note
    which = "backward" if workspace == _own_workspaces(node)[1] else "forward"
    note += (f" The {which} pass of {node.id!r} ({node.class_name}) alone needs "
             f"{workspace / 2**20:,.1f} MiB beyond its inputs and outputs, which no plan "
             "lowers: a smaller batch does.")
    if node.class_name == "TimeDistributed":
        note += (" Keras's TimeDistributed over a fixed number of timesteps calls its "
                 "layer once per timestep, and its gradient holds an input-sized tensor "
                 "for each; Dense and EinsumDense act on the last axis and take the time "
                 "axis directly, without TimeDistributed.")
    return note


def _shared_note(graph: PlanGraph) -> str:
    """What shared layers do to the plans of `graph`, if it has any."""
    calls = collections.Counter(n.layer for n in graph.nodes if n.class_name != "InputLayer")
    shared = sorted(layer for layer, count in calls.items() if count > 1)
    if not shared:
        return ""
    names = ", ".join(shared[:4]) + (", ..." if len(shared) > 4 else "")
    return (f"{len(shared)} layer(s) of this model are called more than once ({names}): "
            "all calls of a shared layer stay in one recompute segment, which limits what "
            "can be recomputed (docs/limitations.md).")


def _noted(plan: Plan, note: str) -> Plan:
    """`plan` with `note` in its estimates."""
    plan.estimates = dataclasses.replace(plan.estimates, note=note)
    return plan


def _recompute_bases(attempts: list[Callable[[int], Plan]], lowest: int,
                     unplanned: int) -> list[Plan]:
    """Recompute plans to offload on top of, one per budget of `OFFLOAD_LADDER`
    (the first attempt that meets it), each distinct plan once."""
    bases: dict[str, Plan] = {}
    for fraction in OFFLOAD_LADDER:
        budget = round(lowest + fraction * (unplanned - lowest))
        for attempt in attempts:
            try:
                plan = attempt(budget)
            except (BudgetError, DPTimeout):
                continue
            bases.setdefault(repr(plan.segments), plan)
            break
    return list(bases.values())
