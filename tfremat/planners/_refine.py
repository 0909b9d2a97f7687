"""Simulator-driven local search lowering the peak of a recompute plan.

Flat plans (one level of segments) stop at a floor set by what is alive where
the simulated peak occurs: checkpoints kept for segments that run later in the
backward pass, and the recomputed insides of the segment being back-propagated.
Chen et al.'s recursion (Sec. 4.4) removes both everywhere, for about one more
forward pass per level; here it is applied only where it pays. Each round looks
at the simulated peak step and tries:

- merging the top-level units from a live checkpoint's producer to its reader
  into one segment that nests the old segments as children: the checkpoint is
  no longer kept through the peak, for one more forward of the children;
- splitting the innermost segment holding the peak's layer call, into nested
  children (less alive while it is back-propagated) or, at the top level, into
  two segments (a checkpoint more, no extra forward);
- isolating a branch whose recomputed result is kept through the peak for a
  later backward step (e.g. a projection shortcut) as a nested child, so it is
  recomputed just before that step.

Moves that would split the calls of a shared layer between segments are not
tried. The move with the lowest simulated peak is taken while it lowers the peak,
until the plan meets the budget or `max_evals` simulations were spent. Every
step is deterministic, so a budget equal to a peak the search reached is
reached again.
"""

from __future__ import annotations

import itertools
from typing import Iterator

from tfremat.core import Plan, PlanGraph, Segment, shared_layer_groups
from tfremat.planners.toolkit import activation_bytes
from tfremat.simulation import Estimate, Schedule, build_schedule, simulate, units

#: Simulations one search may spend (10-40 ms each on a 500-call graph).
MAX_EVALS = 48

#: Live checkpoints tried per round, largest first.
CHECKPOINTS_PER_ROUND = 4


def lower_peak(graph: PlanGraph, segments: list[Segment], budget_bytes: int | None,
               max_evals: int = MAX_EVALS) -> list[Segment]:
    """Reshapes `segments` until the simulated peak fits `budget_bytes`.

    Args:
        graph: The PlanGraph.
        segments: Valid top-level segments (children allowed).
        budget_bytes: Stop once the simulated peak is at most this (None: go on
            while the peak drops).
        max_evals: Simulations the search may spend.

    Returns:
        Valid segments whose simulated peak is at most that of `segments`.
    """
    best, est = segments, simulate(graph, Plan.from_segments(graph, segments),
                                         validate=False)
    evals = 1
    while evals < max_evals and (budget_bytes is None or est.peak_bytes > budget_bytes):
        found = None
        for candidate in _moves(graph, best, est):
            if evals >= max_evals:
                break
            trial = simulate(graph, Plan.from_segments(graph, candidate), validate=False)
            evals += 1
            if trial.peak_bytes < (found[1] if found else est).peak_bytes:
                found = (candidate, trial)
        if found is None:
            break
        best, est = found
    return best


def _peak_index(est: Estimate) -> int:
    values = [v for _, v in est.timeline]
    return values.index(max(values))


def _node_of(label: str) -> str | None:
    """The layer call a step label names (`"bwd X"`, `"fwd X (recompute 1)"`,
    `"bwd X (first ops)"`)."""
    if label.startswith(("bwd ", "fwd ")):
        return label[4:].split(" (", 1)[0]
    return None


def _moves(graph: PlanGraph, segments: list[Segment], est: Estimate
           ) -> Iterator[list[Segment]]:
    """Candidate plans around the peak: merges, splits, isolated branches."""
    schedule = build_schedule(graph, Plan.from_segments(graph, segments))
    peak = _peak_index(est)
    shared = list(shared_layer_groups(graph).values())
    for candidate in itertools.chain(_reshaped(graph, segments, schedule, peak),
                                     _isolations(graph, segments, schedule, peak)):
        if _keeps_shared_layers_whole(candidate, shared):
            yield candidate


def _reshaped(graph: PlanGraph, segments: list[Segment], schedule: Schedule, peak: int
              ) -> Iterator[list[Segment]]:
    """Merges of the units around live checkpoints, and splits of the segment
    holding the peak."""
    top = units(graph, [n.id for n in graph], segments)
    position = {}
    for k, unit in enumerate(top):
        for nid in (unit.nodes if isinstance(unit, Segment) else [unit.id]):
            position[nid] = k
    seen: set[tuple[int, int]] = set()
    tried = 0
    for producer, reader in _live_checkpoints(schedule, peak):
        first, last = position[producer], position.get(reader, position[producer])
        if graph.node(producer).is_input or tried >= CHECKPOINTS_PER_ROUND:
            continue
        tried += 1
        # The producer's unit to the reader's, and one unit wider on either side
        # (a merged range must not keep more inputs than the checkpoint it drops).
        for span in ((first, last), (first - 1, last), (first, last + 1)):
            if span in seen or span[0] < 0 or span[1] >= len(top) or span[0] >= span[1]:
                continue
            seen.add(span)
            yield _merged(graph, top, *span)
    node = _node_of(schedule.labels[peak])
    if node is not None:
        yield from _splits(graph, segments, node)


def _isolations(graph: PlanGraph, segments: list[Segment], schedule: Schedule, peak: int
                ) -> Iterator[list[Segment]]:
    """Plans recomputing a branch whose result is kept through the peak just
    before its backward instead."""
    for producer, reader in _live_recomputed(schedule, peak)[:CHECKPOINTS_PER_ROUND]:
        isolated = _isolated(graph, segments, producer, reader)
        if isolated is not None:
            yield isolated


#: Keys of the schedule's buffers that no forward call makes (`Schedule`).
_NOT_FORWARD = ("grad", "grad-sum", "wgrad", "update early")


def _live_checkpoints(schedule: Schedule, step: int) -> list[tuple[str, str]]:
    """`(producer, last backward reader)` of the forward buffers kept through
    `step`, largest first."""
    found = []
    for key, start in schedule.alloc_step.items():
        if (start >= schedule.loss_step or schedule.last_use[key] < step
                or not schedule.size[key] or key[0] in _NOT_FORWARD):
            continue
        reader = _node_of(schedule.labels[schedule.last_use[key]])
        if reader is None:
            continue
        producer = key[0].split("#", 1)[0].rsplit(":", 1)[0]
        found.append((schedule.size[key], producer, reader))
    found.sort(key=lambda f: -f[0])
    return [(p, r) for _, p, r in found]


def _live_recomputed(schedule: Schedule, step: int) -> list[tuple[str, str]]:
    """`(producer, last backward reader)` of the buffers made by recomputation
    and kept through `step` for a later backward step, largest first."""
    found = []
    for key, start in schedule.alloc_step.items():
        last = schedule.last_use[key]
        if (start <= schedule.loss_step or not start <= step < last
                or not schedule.size[key] or key[0] in _NOT_FORWARD
                or not schedule.labels[last].startswith("bwd ")):
            continue
        producer = key[0].split("#", 1)[0].rsplit(":", 1)[0]
        found.append((schedule.size[key], producer, _node_of(schedule.labels[last])))
    found.sort(key=lambda f: -f[0])
    return [(p, r) for _, p, r in found]


def _isolated(graph: PlanGraph, segments: list[Segment], producer: str, reader: str
              ) -> list[Segment] | None:
    """The plan with the calls from `producer` to `reader` as a new child of the
    innermost segment holding both, so the producer's result is recomputed
    just before its reader's backward instead of kept; None when impossible."""
    path = [s for s in _path_to(segments, producer) if reader in s.nodes]
    if not path:
        return None
    parent = path[-1]
    inside = set(parent.nodes)
    below = _reach(graph.successors(), producer, inside)
    above = _reach({n: graph.predecessors(n) for n in inside}, reader, inside)
    child = below & above
    taken = {n for c in parent.children for n in c.nodes}
    if not child or child & taken or child == inside:
        return None
    children = sorted(parent.children + [Segment(sorted(child, key=graph.index))],
                      key=lambda c: graph.index(c.nodes[0]))
    return _replace(segments, parent, [Segment(parent.nodes, children)])


def _reach(edges: dict[str, list[str]], start: str, inside: set[str]) -> set[str]:
    """Nodes of `inside` reachable from `start` along `edges`, `start` included."""
    seen, stack = {start}, [start]
    while stack:
        for nxt in edges.get(stack.pop(), []):
            if nxt in inside and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _keeps_shared_layers_whole(segments: list[Segment], shared: list[list[str]]) -> bool:
    """Whether every segment, nested ones included, holds all or none of the
    calls of each shared layer."""
    for seg in segments:
        ids = set(seg.nodes)
        if any(0 < len(ids.intersection(calls)) < len(calls) for calls in shared):
            return False
        if not _keeps_shared_layers_whole(seg.children, shared):
            return False
    return True


def _merged(graph: PlanGraph, top: list, first: int, last: int) -> list[Segment]:
    """Top-level units `first..last` as one segment nesting the segments among them."""
    inside = top[first:last + 1]
    nodes = [nid for u in inside for nid in (u.nodes if isinstance(u, Segment) else
                                             ([] if u.is_input else [u.id]))]
    children = [u for u in inside if isinstance(u, Segment)]
    merged = Segment(sorted(nodes, key=graph.index), children)
    return ([u for u in top[:first] if isinstance(u, Segment)] + [merged]
            + [u for u in top[last + 1:] if isinstance(u, Segment)])


def _splits(graph: PlanGraph, segments: list[Segment], node: str
            ) -> Iterator[list[Segment]]:
    """Plans splitting the innermost childless segment holding `node`."""
    path = _path_to(segments, node)
    if not path or path[-1].children or len(path[-1].nodes) < 2:
        return
    target = path[-1]
    order = sorted(target.nodes, key=graph.index)
    for parts in (2, 3):
        runs = _balanced_runs(graph, order, parts)
        if len(runs) < 2:
            continue
        children = [Segment(r) for r in runs]
        yield _replace(segments, target, [Segment(list(target.nodes), children)])
        if len(path) == 1 and parts == 2:
            yield _replace(segments, target, children)


def _path_to(segments: list[Segment], node: str) -> list[Segment]:
    for seg in segments:
        if node in seg.nodes:
            return [seg] + _path_to(seg.children, node)
    return []


def _replace(segments: list[Segment], old: Segment, new: list[Segment]) -> list[Segment]:
    out = []
    for seg in segments:
        if seg is old:
            out += new
        else:
            out.append(Segment(seg.nodes, _replace(seg.children, old, new)))
    return out


def _balanced_runs(graph: PlanGraph, order: list[str], parts: int) -> list[list[str]]:
    """Contiguous runs of `order` with about equal activation bytes (each convex
    when `order` is a convex segment sorted topologically)."""
    sizes = [activation_bytes(graph.node(n)) + 1 for n in order]
    total = sum(sizes)
    runs: list[list[str]] = [[]]
    acc = 0
    for nid, size in zip(order, sizes):
        if runs[-1] and acc >= total * len(runs) / parts and len(runs) < parts:
            runs.append([])
        runs[-1].append(nid)
        acc += size
    return [r for r in runs if r]
