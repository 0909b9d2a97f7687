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


def validate_plan(plan: Plan, graph: PlanGraph) -> None:
    """Checks that `plan` can be applied to the model whose graph is `graph`.

    Args:
        plan: The plan to apply.
        graph: The model's graph: `structure_graph` of its call sites
            (functional models) or its extracted graph (subclassed models).

    Raises:
        PlanMismatchError: the plan was made for another graph.
        PlanValidationError: a segment names unknown nodes or an input layer,
            overlaps another, is not convex, or splits the calls of a shared
            layer (nested segments included: a layer saved in two sub-models
            would load as two layers); or the plan asks for host offload,
            which the rewriter does not apply yet.
    """
    plan.validate(graph)
    _check_nested_shared_layers(graph, plan.segments)
    if plan.offloaded:
        raise PlanValidationError(
            f"The plan offloads {len(plan.offloaded)} tensor(s) to the host; the "
            "rewriter applies recompute segments only. Plan without offload.")


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
