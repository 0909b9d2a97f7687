"""Chen et al. 2016, *Training Deep Nets with Sublinear Memory Cost*.

Four planners over the topological order of a PlanGraph:

- `chen_sqrt`: about sqrt(n) segments cut where a single tensor crosses (Sec. 4.3).
- `chen_greedy`: Alg. 3 with budget parameter B plus the grid search over B of
  Appendix A, choosing by the simulator's exact peak.
- `chen_drop_cheap`: keep the results of expensive calls, recompute cheap ones
  (Sec. 4.2), judged by the cost model.
- `chen_recursive`: segments nested in segments (Sec. 4.4), O(log n) memory on
  chains.

Segments are runs of the topological order, so they are convex; the last run of
`chen_sqrt` and `chen_greedy` is not recomputed (its backward follows its forward
at once, so dropping its results would only cost time).
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from tfremat.core import Plan, PlanGraph, Segment, split_ref
from tfremat.planners import toolkit as seg


def chen_sqrt(graph: PlanGraph, budget_bytes: int | None = None, *,
              num_segments: int | None = None) -> Plan:
    """Cuts the graph into about sqrt(n) segments at single-tensor cuts.

    Args:
        graph: The PlanGraph.
        budget_bytes: Optional device budget; checked against the simulator.
        num_segments: Number of parts to cut the n recomputable nodes into
            (default `round(sqrt(n))`); all but the last are recomputed.

    Returns:
        The Plan, estimates from `simulate`.

    Raises:
        BudgetError: the plan's simulated peak exceeds `budget_bytes`.
    """
    positions = seg.planned_positions(graph)
    parts = num_segments or max(1, round(math.sqrt(len(positions))))
    cuts = _even_cuts(positions, seg.single_tensor_cuts(graph), parts - 1)
    plan = _plan_from_cuts(graph, cuts, planner="chen-sqrt", budget_bytes=budget_bytes,
                           settings={"num_segments": parts})
    return seg.best_plan([plan], budget_bytes, "chen-sqrt")


def chen_greedy(graph: PlanGraph, budget_bytes: int, *, grid_size: int = 6,
                grid_span: float = 2.0) -> Plan:
    """Alg. 3 of Chen et al. with a grid search over its parameter B.

    Alg. 3 walks the topological order adding each call's activation bytes to a
    running total and cuts at the next single-tensor cut once the total exceeds
    B. As in Appendix A, a first run with B = 0 gives x (bytes kept at cuts) and
    y (largest segment); the grid spans `[sqrt(xy) / grid_span, sqrt(xy) *
    grid_span]`. Every plan is simulated and the least-overhead plan within
    budget is returned.

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes.
        grid_size: Number of B values on the grid (plus B = 0).
        grid_span: Ratio between the grid's centre and its ends.

    Returns:
        The Plan, estimates from `simulate`.

    Raises:
        BudgetError: no plan of the grid fits; the minimum is the smallest
            simulated peak among them.
    """
    settings = {"grid_size": grid_size, "grid_span": grid_span}
    candidates = set(seg.single_tensor_cuts(graph))
    cuts0, x, y = _alg3(graph, candidates, 0.0)
    centre = math.sqrt(x * y)
    grid = [0.0] + [centre / grid_span * (grid_span ** 2) ** (j / max(grid_size - 1, 1))
                    for j in range(grid_size)]
    plans: dict[tuple[int, ...], Plan] = {}
    for b in grid:
        cuts = tuple(_alg3(graph, candidates, b)[0])
        if cuts not in plans:
            plans[cuts] = _plan_from_cuts(graph, list(cuts), planner="chen-greedy",
                                          budget_bytes=budget_bytes,
                                          settings={**settings, "B": b})
    return seg.best_plan(list(plans.values()), budget_bytes, "chen-greedy",
                         f"Tried {len(plans)} plans of Alg. 3 over a grid of B.")


def chen_drop_cheap(graph: PlanGraph, budget_bytes: int | None = None, *,
                    threshold: float = 0.1) -> Plan:
    """Recomputes cheap calls and keeps the results of expensive ones (Sec. 4.2).

    A call is cheap when its forward cost per activation byte is at most
    `threshold` times the graph's (total forward cost over total activation
    bytes): BatchNorm, activations, pooling and additions next to
    convolutions, whatever their class. Each run of consecutive cheap calls
    becomes a small segment, except a run ending the graph and runs that would
    keep more than they drop: a segment keeps its inputs, so a run is taken only
    if the tensors its backward keeps inside (internal saved tensors, outputs
    read only by its own backward) outweigh its inputs no backward reads.

    Args:
        graph: The PlanGraph.
        budget_bytes: Optional device budget; checked against the simulator.
        threshold: Cheapness threshold relative to the graph's cost per byte.

    Returns:
        The Plan, estimates from `simulate`.

    Raises:
        BudgetError: the plan's simulated peak exceeds `budget_bytes`.
    """
    positions = seg.planned_positions(graph)
    nodes = graph.nodes
    total_bytes = sum(seg.activation_bytes(nodes[p]) for p in positions)
    total_cost = sum(nodes[p].forward_cost for p in positions)
    per_byte = total_cost / total_bytes if total_bytes else 0.0
    runs: list[list[str]] = [[]]
    for p in positions:
        node = nodes[p]
        if node.forward_cost <= threshold * per_byte * seg.activation_bytes(node):
            runs[-1].append(node.id)
        elif runs[-1]:
            runs.append([])
    if runs[-1] and runs[-1][-1] == nodes[positions[-1]].id:
        runs.pop()
    readers = _backward_readers(graph)
    runs = [r for r in runs if r and _drops_more_than_keeps(graph, set(r), readers)]
    segments = seg.valid_segments(graph, runs)
    plan = seg.finish_plan(graph, segments, planner="chen-drop-cheap",
                           budget_bytes=budget_bytes, settings={"threshold": threshold})
    return seg.best_plan([plan], budget_bytes, "chen-drop-cheap")


def chen_recursive(graph: PlanGraph, budget_bytes: int | None = None, *,
                   fanout: int | None = None, min_size: int = 2) -> Plan:
    """Nested segments: each segment is planned again inside (Sec. 4.4).

    The recomputable nodes are split at single-tensor cuts into `fanout + 1`
    parts of equal length, each a segment whose children split it again, down
    to `min_size` nodes: g(n) = k + g(n / (k + 1)) kept results, O(log n) on a
    chain, for about log(n) extra forward passes.

    Args:
        graph: The PlanGraph.
        budget_bytes: Optional device budget in bytes.
        fanout: Results kept per level (k). By default k = 1, 2, 3 are tried and
            the least-overhead plan within budget is returned.
        min_size: Segments of at most this many nodes get no children.

    Returns:
        The Plan, estimates from `simulate`.

    Raises:
        BudgetError: no tried fanout fits; the minimum is the smallest simulated
            peak among them.
    """
    positions = seg.planned_positions(graph)
    cuts = seg.single_tensor_cuts(graph)
    plans = []
    for k in ([fanout] if fanout else [1, 2, 3]):
        tree = _nest(graph, positions, cuts, k, min_size)
        plans.append(seg.finish_plan(graph, tree, planner="chen-recursive",
                                     budget_bytes=budget_bytes,
                                     settings={"fanout": k, "min_size": min_size}))
    return seg.best_plan(plans, budget_bytes, "chen-recursive")


# -- helpers -------------------------------------------------------------------


def _alg3(graph: PlanGraph, candidates: set[int], budget: float
          ) -> tuple[list[int], float, float]:
    """Alg. 3: cut positions, bytes kept at cuts (x), largest segment (y)."""
    temp = x = y = 0.0
    cuts = []
    for p in seg.planned_positions(graph):
        size = seg.activation_bytes(graph.nodes[p])
        temp += size
        if p in candidates and temp > budget:
            x += size
            y = max(y, temp)
            temp = 0.0
            cuts.append(p)
    return cuts, x, y


def _backward_readers(graph: PlanGraph) -> dict[str, set[str]]:
    """Map from each tensor reference to the ids of calls whose backward reads it."""
    readers: dict[str, set[str]] = {}
    for node in graph:
        for ref in node.backward_reads:
            readers.setdefault(ref, set()).add(node.id)
    return readers


def _drops_more_than_keeps(graph: PlanGraph, run: set[str],
                           readers: dict[str, set[str]]) -> bool:
    """Whether recomputing `run` frees more bytes than keeping its inputs costs."""
    dropped = 0
    for nid in run:
        node = graph.node(nid)
        dropped += node.internal_saved_bytes
        for i, t in enumerate(node.outputs):
            who = readers.get(node.output_ref(i), set())
            if who and who <= run:
                dropped += t.bytes
    inputs = {r for nid in run for r in graph.node(nid).inputs
              if split_ref(r)[0] not in run}
    kept = sum(graph.tensor(r).bytes for r in inputs
               if r not in readers and not graph.node(split_ref(r)[0]).is_input)
    return dropped > kept


def _even_cuts(positions: Sequence[int], candidates: Sequence[int], count: int) -> list[int]:
    """Up to `count` candidate cuts nearest to an even split of `positions`."""
    if count <= 0 or not candidates:
        return []
    # Number of recomputable nodes at or before each candidate cut.
    before = [bisect.bisect_right(positions, c) for c in candidates]
    chosen = set()
    for j in range(1, count + 1):
        target = j * len(positions) / (count + 1)
        best = min(range(len(candidates)), key=lambda i: abs(before[i] - target))
        chosen.add(candidates[best])
    return sorted(chosen)


def _runs(positions: Sequence[int], cuts: Sequence[int]) -> tuple[list[list[int]], list[int]]:
    """Splits positions after each cut: (recomputed runs, tail after the last cut)."""
    runs: list[list[int]] = [[]]
    cut_set = set(cuts)
    for p in positions:
        runs[-1].append(p)
        if p in cut_set:
            runs.append([])
    return [r for r in runs[:-1] if r], runs[-1]


def _plan_from_cuts(graph: PlanGraph, cuts: Sequence[int], *, planner: str,
                    budget_bytes: int | None, settings: dict) -> Plan:
    positions = seg.planned_positions(graph)
    runs = [list(range(r[0], r[-1] + 1)) for r in _runs(positions, cuts)[0]]
    runs = seg.merge_shared_runs(graph, runs)
    ids = [[graph.nodes[p].id for p in r] for r in runs]
    return seg.finish_plan(graph, seg.valid_segments(graph, ids), planner=planner,
                           budget_bytes=budget_bytes, settings=settings)


def _nest(graph: PlanGraph, positions: Sequence[int], cuts: Sequence[int], fanout: int,
          min_size: int) -> list[Segment]:
    """Splits `positions` into fanout + 1 segments, each nested again."""
    inner = [c for c in cuts if positions[0] <= c < positions[-1]]
    chosen = _even_cuts(positions, inner, fanout)
    if not chosen:
        return []
    runs, tail = _runs(positions, chosen)
    runs = [list(range(r[0], r[-1] + 1)) for r in runs + [tail] if r]
    runs = seg.merge_shared_runs(graph, runs)
    if len(runs) < 2:  # shared layers merged every part: this range is not nested
        return []
    out = []
    for run in runs:
        part = [p for p in run if not graph.nodes[p].is_input]
        children = _nest(graph, part, cuts, fanout, min_size) if len(part) > min_size else []
        out.append(Segment([graph.nodes[p].id for p in part], children))
    return out
