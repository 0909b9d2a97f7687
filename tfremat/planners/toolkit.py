"""Helpers shared by the planners: cut points, valid segments, finished plans.

Every planner ends the same way: its node sets are made valid (no InputLayer,
convex, shared layers whole), wrapped in a Plan, and the Plan's estimates come
from the simulator, the ground truth of what a budget means.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from tfremat.core import (BudgetError, Node, Plan, PlanGraph, Segment, recompute_units,
                          shared_layer_groups, split_ref)
from tfremat.simulation import requires_grad, simulate

def activation_bytes(node: Node) -> int:
    """Bytes a call's forward results occupy: outputs plus internal saved tensors."""
    if node.is_input:
        return 0
    return node.output_bytes + node.internal_saved_bytes


def planned_positions(graph: PlanGraph) -> list[int]:
    """Topological positions of the nodes a planner may recompute (no InputLayer)."""
    return [i for i, n in enumerate(graph.nodes) if not n.is_input]


def single_tensor_cuts(graph: PlanGraph) -> list[int]:
    """Positions `p` where exactly one tensor crosses a cut after node `p`.

    A tensor made at position `a` and last read at position `b` (the loss, after
    every node, for model outputs) crosses the cuts after `a, ..., b - 1`.
    Tensors of InputLayers are left out: they are part of the batch and always
    kept. Valid on any DAG; on a chain every position is a cut.

    Args:
        graph: The PlanGraph.

    Returns:
        The sorted cut positions.
    """
    n = len(graph)
    last: dict[str, int] = {}
    for i, node in enumerate(graph.nodes):
        for ref in node.inputs:
            last[ref] = i
    for ref in graph.outputs:
        last[ref] = n
    diff = [0] * (n + 1)
    for ref, end in last.items():
        start = graph.index(split_ref(ref)[0])
        if graph.nodes[start].is_input:
            continue
        diff[start] += 1
        diff[end] -= 1
    cuts, crossing = [], 0
    for p in range(n - 1):
        crossing += diff[p]
        if crossing == 1:
            cuts.append(p)
    return cuts


def merge_shared_runs(graph: PlanGraph, runs: list[list[int]]) -> list[list[int]]:
    """Merges consecutive runs of positions so each shared layer lies in one run.

    Args:
        graph: The PlanGraph.
        runs: Contiguous, ordered, disjoint runs of topological positions.

    Returns:
        Runs where the calls of a shared layer that fall into runs all fall into
        the same run (calls outside every run are left to `valid_segments`).
    """
    groups = list(shared_layer_groups(graph).values())
    runs = [list(r) for r in runs]
    changed = True
    while changed:
        changed = False
        run_of = {p: k for k, r in enumerate(runs) for p in r}
        for calls in groups:
            owners = sorted({run_of[graph.index(c)] for c in calls
                             if graph.index(c) in run_of})
            if len(owners) > 1:
                lo, hi = owners[0], owners[-1]
                merged = list(range(runs[lo][0], runs[hi][-1] + 1))
                runs = runs[:lo] + [merged] + runs[hi + 1:]
                changed = True
                break
    return runs


def merge_shared_blocks(graph: PlanGraph, blocks: Sequence[tuple[list[str], bool]]
                        ) -> list[list[str]]:
    """Merges consecutive blocks of a lower-set sequence around shared layers.

    The union of consecutive blocks L_j \\ L_{i-1} is convex, so merging every
    range of blocks that holds the calls of one shared layer keeps each shared
    layer whole. A merged range is recomputed if any of its blocks was. A range
    reaching the last block (never recomputed) is not merged: its blocks stay
    apart and `valid_segments` keeps the shared calls out of them.

    Args:
        graph: The PlanGraph.
        blocks: `(node ids, recomputed)` of each block V_1, ..., V_k.

    Returns:
        The node sets to recompute, in order.
    """
    block_of = {nid: i for i, (ids, _) in enumerate(blocks) for nid in ids}
    reach = list(range(len(blocks)))  # reach[i]: last block merged with block i
    for calls in shared_layer_groups(graph).values():
        owners = [block_of[c] for c in calls if c in block_of]
        if owners:
            reach[min(owners)] = max(reach[min(owners)], max(owners))
    out, start = [], 0
    while start < len(blocks):
        end = start
        i = start
        while i <= end:
            end = max(end, reach[i])
            i += 1
        if end == len(blocks) - 1:
            # Merging into the last block would recompute nothing: keep the
            # blocks, `valid_segments` takes the shared calls out of them.
            out += [ids for ids, flag in blocks[start:end] if flag]
        elif any(flag for _, flag in blocks[start:end + 1]):
            out.append([nid for ids, _ in blocks[start:end + 1] for nid in ids])
        start = end + 1
    return out


def convex_pieces(graph: PlanGraph, ids: Sequence[str]) -> list[list[str]]:
    """Splits node ids into convex pieces, each a run of them in topological order.

    A node joins the current piece unless a path from the piece reaches it
    through a node outside the piece; then it starts a new piece. Because pieces
    follow each other in topological order, contracting them keeps the graph
    acyclic.

    Args:
        graph: The PlanGraph.
        ids: Node ids.

    Returns:
        The pieces, in topological order.
    """
    order = sorted(set(ids), key=graph.index)
    if not order:
        return []
    members = set(order)
    pieces: list[list[str]] = []
    current: list[str] = []
    inside: set[str] = set()
    tainted: set[str] = set()  # outside the piece, reachable from it
    for idx in range(graph.index(order[0]), graph.index(order[-1]) + 1):
        nid = graph.nodes[idx].id
        preds = graph.predecessors(nid)
        if nid in members:
            if any(p in tainted for p in preds):
                pieces.append(current)
                current, inside, tainted = [], set(), set()
            current.append(nid)
            inside.add(nid)
        elif any(p in inside or p in tainted for p in preds):
            tainted.add(nid)
    pieces.append(current)
    return pieces


def valid_segments(graph: PlanGraph, node_sets: Iterable[Iterable[str]]) -> list[list[str]]:
    """Turns node sets into segments that `Plan.validate` accepts.

    InputLayers are removed, each set is split into convex pieces (and, on a
    subclassed model, into the units the rewriter recomputes: one per node,
    see `tfremat.core.recompute_units`), and the calls of a shared layer that
    do not all land in one piece are taken out of the segments (kept instead
    of recomputed), repeating until stable.

    Args:
        graph: The PlanGraph.
        node_sets: Node sets, disjoint, ordered so that contracting them keeps
            the graph acyclic (e.g. runs of the topological order, or the
            blocks of a lower-set sequence).

    Returns:
        Non-empty, convex, disjoint segments in topological order.
    """
    groups = list(shared_layer_groups(graph).values())
    sets = [[n for n in s if not graph.node(n).is_input] for s in node_sets]
    while True:
        pieces = [p for s in sets for p in convex_pieces(graph, s) if p]
        pieces = [u.nodes for u in recompute_units(graph, [Segment(p) for p in pieces])]
        piece_of = {n: k for k, p in enumerate(pieces) for n in p}
        broken = {c for calls in groups
                  if len({piece_of.get(c) for c in calls}) > 1 for c in calls}
        if not broken:
            return pieces
        sets = [[n for n in p if n not in broken] for p in pieces]


def finish_plan(graph: PlanGraph, segments: Sequence[Segment | list[str]], *,
                planner: str, budget_bytes: int | None, settings: dict[str, Any],
                details: dict[str, Any] | None = None) -> Plan:
    """Wraps segments in a validated Plan whose estimates come from `simulate`.

    Segments the backward pass does not reach are dropped (`reached_only`),
    and so are those that keep nothing out of memory (`busy_only`) when the
    simulator predicts no higher peak without them.

    Args:
        graph: The PlanGraph.
        segments: Valid segments (lists of ids or Segments with children).
        planner: Planner name recorded in the plan.
        budget_bytes: Budget recorded in the plan.
        settings: Planner settings recorded in the plan.
        details: The planner's own figures, recorded in the estimates.

    Returns:
        The Plan, with `PlanEstimate` from the simulator.
    """
    if graph.metadata.get("subclassed", False):
        # One unit per call there (`recompute_units`): the plan says what runs.
        segments = valid_segments(graph, [getattr(s, "nodes", s) for s in segments])
    segments = reached_only(segments, requires_grad(graph))
    plans = []
    for kept in (busy_only(graph, segments), segments):
        plan = Plan.from_segments(graph, list(kept), planner=planner,
                                  budget_bytes=budget_bytes, settings=dict(settings))
        plan.validate(graph)
        plan.estimates = simulate(graph, plan, validate=False).plan_estimate(details=details)
        plans.append(plan)
        if kept == list(segments):
            break  # nothing idle: one plan
    return plans[0] if plans[0].peak_bytes <= plans[-1].peak_bytes else plans[-1]


def busy_only(graph: PlanGraph, segments: Sequence[Segment | list[str]],
              consumers: dict[str, list[str]] | None = None) -> list[Segment | list[str]]:
    """`segments` (and their children) without those that keep nothing out of
    memory (`PlanGraph.dropped_bytes` is 0) and have no children: every
    output of such a segment is read outside it, so its recompute costs time
    and frees nothing (chen-greedy made a one-convolution segment of a new
    user's stem so).

    Args:
        graph: The PlanGraph.
        segments: Segments, as Segments or lists of node ids.
        consumers: `graph.consumers()`, when the caller has it.

    Returns:
        The segments that keep something out of memory, in order.
    """
    if segments and consumers is None:
        consumers = graph.consumers()
    out: list[Segment | list[str]] = []
    for s in segments:
        nodes = getattr(s, "nodes", s)
        children = busy_only(graph, s.children, consumers) if isinstance(s, Segment) else []
        if not children and graph.dropped_bytes(nodes, consumers) == 0:
            continue
        out.append(Segment(list(nodes), children) if isinstance(s, Segment) else s)
    return out


def reached_only(segments: Sequence[Segment | list[str]], reached: dict[str, bool]
                 ) -> list[Segment | list[str]]:
    """`segments` (and their children) without those the backward pass does
    not reach at all.

    A segment no gradient flows into (every call in it has no trainable
    weights before it: a frozen backbone in fine-tuning) is never
    recomputed, while the inputs it would be recomputed from are kept to the
    end of the step: it costs memory and saves none.

    Args:
        segments: Segments, as Segments or lists of node ids.
        reached: Whether a gradient flows into each node
            (`tfremat.simulation.requires_grad`).

    Returns:
        The segments with a node the backward pass reaches, in order.
    """
    out: list[Segment | list[str]] = []
    for s in segments:
        if not any(reached[n] for n in getattr(s, "nodes", s)):
            continue
        if isinstance(s, Segment) and s.children:
            s = Segment(list(s.nodes), reached_only(s.children, reached))
        out.append(s)
    return out


def fits(plan: Plan, budget_bytes: int | None) -> bool:
    """Whether the plan's simulated peak is within the budget (None: no budget)."""
    return budget_bytes is None or plan.peak_bytes <= budget_bytes


def cost(plan: Plan) -> tuple[float, int]:
    """How plans that fit are ranked: least overhead, then smallest peak."""
    return (plan.estimates.overhead, plan.peak_bytes)


def best_plan(plans: Sequence[Plan], budget_bytes: int | None, planner: str,
              detail: str = "") -> Plan:
    """Picks the least-overhead plan within budget, else raises BudgetError.

    Args:
        plans: Candidate plans with simulator estimates.
        budget_bytes: The budget (None: no budget, pick least overhead).
        planner: Planner name for the error.
        detail: Extra text for the error.

    Returns:
        The plan within budget with least overhead (then smallest peak).

    Raises:
        BudgetError: no plan fits; its minimum is the smallest simulated peak.
    """
    within = [p for p in plans if fits(p, budget_bytes)]
    if within:
        return min(within, key=cost)
    lowest = min(p.peak_bytes for p in plans)
    raise BudgetError(budget_bytes, lowest, planner, detail)
