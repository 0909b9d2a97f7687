"""Checking a Plan against the model it is applied to.

For functional and Sequential models the rewriter does not trace the model: it
builds a lightweight `PlanGraph` (structure only, no costs) from the model's
call sites. Subclassed models are checked against their extracted graph.
Either way `Plan.validate` runs the checks the planners' plans go through.
"""

from __future__ import annotations

from typing import Any, Iterable

from tfremat.errors import PlanValidationError
from tfremat.graph.keras_graph import CallSite
from tfremat.graph.plan_graph import Node, PlanGraph, TensorInfo
from tfremat.planners.plan import Plan, Segment, shared_layer_groups


def _tensor_info(tensor: Any) -> TensorInfo:
    shape = [1 if d is None else d for d in getattr(tensor, "shape", ())]
    return TensorInfo.of(shape, str(getattr(tensor, "dtype", "float32")))


def structure_graph(sites: Iterable[CallSite], name: str = "model") -> PlanGraph:
    """A `PlanGraph` holding only the structure of `sites`.

    Args:
        sites: Call sites of a model (`tfremat.graph.keras_graph.walk`).
        name: Name of the graph (the model's name).

    Returns:
        A `PlanGraph` with one node per call site; its `fingerprint()` equals
        the fingerprint of the fully extracted graph of the same model.
    """
    nodes = [
        Node(id=s.id, layer=s.layer_key, class_name=s.class_name,
             inputs=list(s.inputs),
             outputs=[_tensor_info(t) for t in s.output_tensors])
        for s in sites
    ]
    return PlanGraph(nodes=nodes, name=name)


def validate_plan(plan: Plan, graph: PlanGraph, outputs: Iterable[str] = ()) -> None:
    """Checks that `plan` can be applied to the model whose graph is `graph`.

    Args:
        plan: The plan to apply.
        graph: The model's graph: `structure_graph` of its call sites
            (functional models) or its extracted graph (subclassed models).
        outputs: References of the model's outputs (offload checks).

    Raises:
        PlanMismatchError: the plan was made for another graph.
        PlanValidationError: a segment names unknown nodes or an input layer,
            overlaps another, is not convex, or splits the calls of a shared
            layer (nested segments included: a layer saved in two sub-models
            would load as two layers); or an offload cannot be applied (see
            `_check_offloads`).
    """
    plan.validate(graph)
    _check_nested_shared_layers(graph, plan.segments)
    _check_offloads(plan, graph, set(outputs))


def _check_offloads(plan: Plan, graph: PlanGraph, outputs: set[str]) -> None:
    """Offloaded tensors must be read by layer calls outside recompute
    segments or be inputs of top-level segments, and not be model outputs
    (the loss reads those); each is offloaded once; a prefetch trigger must
    have a floating input and come after every reader in the forward order."""
    consumers = graph.consumers()
    segment_of = {n: k for k, seg in enumerate(plan.segments) for n in seg.nodes}
    seen: set[str] = set()
    for off in plan.offloaded:
        ref = off.tensor
        if ref in seen:
            raise PlanValidationError(f"Tensor {ref!r} is offloaded twice.")
        seen.add(ref)
        producer = ref.rsplit(":", 1)[0]
        readers = consumers.get(ref, [])
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


def _check_nested_shared_layers(graph: PlanGraph, segments: list[Segment]) -> None:
    shared = shared_layer_groups(graph)
    for seg in segments:
        for child in seg.children:
            ids = set(child.nodes)
            for layer, calls in shared.items():
                inside = [c for c in calls if c in ids]
                if inside and len(inside) != len(calls):
                    raise PlanValidationError(
                        f"Shared layer {layer!r} is called by {calls}; nested segment "
                        f"{child.nodes} holds only {inside}. Keep every call of a "
                        "shared layer in one nested segment or outside all of them.")
        _check_nested_shared_layers(graph, seg.children)
