"""The rules a Plan must follow on its graph, in one place.

The planners' plans, plans read from JSON and plans written by hand all go
through `validate_plan` before the simulator, the pictures or the rewriter use
them:

- the plan names this graph (fingerprint);
- segments are non-empty, name known non-input nodes, are disjoint, convex (no
  path leaves a segment and comes back), and nested segments lie inside their
  parent;
- every call of a shared layer is in one segment (at each nesting level) or in
  none, so a saved model holds each layer once;
- an offloaded tensor exists, is offloaded once, is not a model output (the loss
  reads it on the device), is read by some call, is not recomputed inside the
  segment that makes it; its prefetch trigger has a floating input (so its
  gradient runs) and comes after the tensor's last reader in the forward order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from tfremat.core.errors import PlanValidationError
from tfremat.core.graph import PlanGraph

if TYPE_CHECKING:
    from tfremat.core import Plan, Segment


def validate_plan(plan: "Plan", graph: PlanGraph) -> None:
    """Checks that `plan` is well formed for `graph` (see the module docstring).

    Args:
        plan: The plan.
        graph: The graph it claims to be made for.

    Raises:
        PlanMismatchError: the plan names another graph.
        PlanValidationError: a rule is broken; the message names the segment,
            node or tensor.
    """
    plan.check_graph(graph)
    succ = graph.successors()
    _check_segments(graph, plan.segments, None, shared_layer_groups(graph), succ)
    _check_offloads(plan, graph)


def is_convex(graph: PlanGraph, node_ids: set[str],
              succ: dict[str, list[str]] | None = None) -> bool:
    """Whether no path leaves `node_ids` and comes back into it.

    `succ` may pass `graph.successors()` when checking many sets.
    """
    if not node_ids:
        return True
    succ = succ if succ is not None else graph.successors()
    hi = max(graph.index(n) for n in node_ids)
    # Nodes outside the set reachable from it, limited to the index window.
    frontier = [m for n in node_ids for m in succ[n] if m not in node_ids]
    seen: set[str] = set()
    while frontier:
        m = frontier.pop()
        if m in seen or graph.index(m) > hi:
            continue
        seen.add(m)
        for k in succ[m]:
            if k in node_ids:
                return False
            frontier.append(k)
    return True


def shared_layer_groups(graph: PlanGraph) -> dict[str, list[str]]:
    """Map from each layer called more than once to the ids of its calls."""
    groups: dict[str, list[str]] = {}
    for n in graph:
        groups.setdefault(n.layer, []).append(n.id)
    return {k: v for k, v in groups.items() if len(v) > 1}


def _check_segments(graph: PlanGraph, segments: Iterable["Segment"], parent: set[str] | None,
                    shared: dict[str, list[str]], succ: dict[str, list[str]]) -> None:
    seen: set[str] = set()
    for seg in segments:
        if not seg.nodes:
            raise PlanValidationError("A recompute segment is empty.")
        ids = set(seg.nodes)
        unknown = [n for n in seg.nodes if n not in graph]
        if unknown:
            raise PlanValidationError(
                f"Segment names node(s) {unknown} that are not in graph {graph.name!r}.")
        inputs = [n for n in seg.nodes if graph.node(n).is_input]
        if inputs:
            raise PlanValidationError(f"Input layer(s) {inputs} cannot be recomputed.")
        overlap = ids & seen
        if overlap:
            raise PlanValidationError(f"Node(s) {sorted(overlap)} are in two segments.")
        seen |= ids
        if parent is not None and not ids <= parent:
            raise PlanValidationError(
                f"Nested segment {seg.nodes} is not inside its parent segment.")
        if not is_convex(graph, ids, succ):
            raise PlanValidationError(
                f"Segment {seg.nodes} is not convex: a path leaves it and re-enters, "
                "so it cannot run as one recomputed unit.")
        for layer, calls in shared.items():
            inside = [c for c in calls if c in ids]
            if inside and len(inside) != len(calls):
                where = "segment" if parent is None else "nested segment"
                raise PlanValidationError(
                    f"Shared layer {layer!r} is called by {calls}; {where} {seg.nodes} "
                    f"holds only {inside}. Keep every call of a shared layer in one "
                    "segment or outside all segments (a layer saved in two sub-models "
                    "would load as two layers).")
        # Below this segment only the shared layers it holds whole can be split.
        inner_shared = {k: v for k, v in shared.items() if v[0] in ids}
        _check_segments(graph, seg.children, ids, inner_shared, succ)


def _check_offloads(plan: "Plan", graph: PlanGraph) -> None:
    consumers = graph.consumers()
    segment_of = {n: k for k, seg in enumerate(plan.segments) for n in seg.nodes}
    outputs = set(graph.outputs)
    seen: set[str] = set()
    for off in plan.offloaded:
        ref = off.tensor
        if ref not in consumers:
            raise PlanValidationError(f"Offloaded tensor {ref!r} is not in the graph.")
        if ref in seen:
            raise PlanValidationError(f"Tensor {ref!r} is offloaded twice.")
        seen.add(ref)
        producer = ref.rsplit(":", 1)[0]
        readers = consumers[ref]
        if ref in outputs:
            raise PlanValidationError(
                f"Offloaded tensor {ref!r} is a model output: the loss reads it on the "
                "device. Offload an activation inside the model.")
        if not readers:
            raise PlanValidationError(f"Offloaded tensor {ref!r} is read by no layer call.")
        inside = [r for r in readers
                  if r in segment_of and segment_of[r] == segment_of.get(producer)]
        if inside:
            raise PlanValidationError(
                f"Offloaded tensor {ref!r} is read by {inside} inside the recompute "
                "segment that makes it: a recomputed tensor is not kept, so it cannot "
                "be offloaded. Offload it or recompute it, not both.")
        trigger = off.prefetch_after
        if trigger is None:
            continue
        if trigger not in graph:
            raise PlanValidationError(
                f"Prefetch trigger {trigger!r} of {ref!r} is not a node of the graph.")
        node = graph.node(trigger)
        if node.is_input or not any(graph.tensor(r).differentiable for r in node.inputs):
            raise PlanValidationError(
                f"Prefetch trigger {trigger!r} of {ref!r} has no floating input, so "
                "its backward makes no gradient to trigger on. Pick another layer.")
        last = max(readers, key=graph.index)
        if graph.index(trigger) <= graph.index(last):
            raise PlanValidationError(
                f"Prefetch trigger {trigger!r} of {ref!r} must come after its last "
                f"reader {last!r} in the forward order (its gradient runs earlier).")
