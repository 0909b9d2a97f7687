"""Walking a Keras model's layer graph: the call sites tfremat plans over.

A call site is one call of one Keras operation (layer or bare `keras.ops`
operation). For functional and Sequential models the call sites come from the
model's own node graph, in the order Keras runs them, with nested functional
models flattened: the inner layers become call sites with ids
`"inner_model/layer"`. A layer called more than once gets ids `name@0`,
`name@1`, ... in call order.

Subclassed models (a `keras.Model` subclass with its own `call`) have no static
graph; their call sites are the direct sublayers' calls, found while tracing
(`tfremat.graph.tracing`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import keras
from keras.src.models.functional import Functional

from tfremat.core import (Node, PlanGraph, TensorInfo, UnsupportedModelError,
                          structure_fingerprint)


@dataclasses.dataclass
class CallSite:
    """One call of a Keras operation in a model.

    Attributes:
        id: The PlanGraph node id.
        layer_key: Identifies the called operation across calls (`"name"` or
            `"nested_model/name"`); equal for all calls of a shared layer.
        operation: The called Keras operation (same object as in the model).
        node: The Keras `Node` of this call (None for subclassed models).
        inputs: Tensor references `"id:index"` read by the call, in the order of
            `node.input_tensors`.
        input_tensors: The symbolic KerasTensors read (functional models).
        output_tensors: The symbolic KerasTensors made (functional models).
    """

    id: str
    layer_key: str
    operation: Any
    node: Any = None
    inputs: list[str] = dataclasses.field(default_factory=list)
    input_tensors: list[Any] = dataclasses.field(default_factory=list)
    output_tensors: list[Any] = dataclasses.field(default_factory=list)

    @property
    def is_input(self) -> bool:
        return isinstance(self.operation, keras.layers.InputLayer)

    @property
    def class_name(self) -> str:
        return type(self.operation).__name__


def as_functional(model: Any) -> Functional | None:
    """The functional graph of `model`, or None for a subclassed model.

    Raises:
        UnsupportedModelError: a Sequential model that is not built yet.
    """
    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
        if functional is None:
            raise UnsupportedModelError(
                f"Sequential model {model.name!r} is not built. Give its first layer "
                "an input shape (keras.Input(shape=...)) or call model.build(input_shape) "
                "before planning.")
        return functional
    if isinstance(model, Functional):
        return model
    return None


def is_subclassed(model: Any) -> bool:
    """Whether `model` is a `keras.Model` subclass with its own `call`."""
    return as_functional(model) is None


def _ordered_nodes(functional: Functional) -> list[Any]:
    """Nodes in the order `Functional._run_through_graph` executes them."""
    nodes_by_depth = functional._nodes_by_depth
    order = []
    for depth in sorted(nodes_by_depth, reverse=True):
        order.extend(nodes_by_depth[depth])
    return order


def walk(model: Any) -> list[CallSite]:
    """Lists the call sites of a functional or Sequential model.

    Args:
        model: A built functional or Sequential Keras model.

    Returns:
        Call sites in execution order (a topological order): an InputLayer
        call site for each model input first, then the calls, nested
        functional models flattened.

    Raises:
        UnsupportedModelError: for subclassed or unbuilt models.
    """
    return walk_with_outputs(model)[0]


def walk_with_outputs(model: Any) -> tuple[list[CallSite], list[str]]:
    """Like `walk`, also returning the references of the model's outputs."""
    functional = as_functional(model)
    if functional is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is a subclassed model; its call sites are found "
            "by tracing (tfremat.graph.tracing).")
    sites: list[CallSite] = []
    keys: dict[int, str] = {}  # id(operation) -> layer key of its first call

    def visit(fn: Functional, prefix: str, key_prefix: str,
              refs: dict[int, str]) -> None:
        nodes = [n for n in _ordered_nodes(fn) if not (n.is_input and prefix)]
        calls = collections.Counter(id(n.operation) for n in nodes)
        seen: collections.Counter = collections.Counter()
        for node in nodes:
            op = node.operation
            name = op.name
            if calls[id(op)] > 1:
                name = f"{op.name}@{seen[id(op)]}"
                seen[id(op)] += 1
            ins = list(node.input_tensors)
            if any(id(t) not in refs for t in ins):
                raise UnsupportedModelError(
                    f"Cannot follow the graph of {fn.name!r} at {op.name!r}: an input "
                    "does not come from the model's inputs.")
            inner = as_functional(op) if isinstance(op, keras.Model) else None
            if inner is not None:
                if len(ins) != len(inner.inputs):
                    raise UnsupportedModelError(
                        f"Nested model {op.name!r} is called with {len(ins)} tensors "
                        f"but has {len(inner.inputs)} inputs.")
                inner_refs = {id(it): refs[id(t)] for it, t in zip(inner.inputs, ins)}
                visit(inner, f"{prefix}{name}/", f"{key_prefix}{op.name}/", inner_refs)
                for outer_t, inner_t in zip(node.outputs, inner.outputs):
                    refs[id(outer_t)] = inner_refs[id(inner_t)]
                continue
            site = CallSite(
                id=prefix + name,
                layer_key=keys.setdefault(id(op), key_prefix + op.name),
                operation=op, node=node,
                inputs=[refs[id(t)] for t in ins],
                input_tensors=ins, output_tensors=list(node.outputs))
            sites.append(site)
            for i, t in enumerate(node.outputs):
                refs[id(t)] = f"{site.id}:{i}"

    refs: dict[int, str] = {}
    visit(functional, "", "", refs)
    # The model's inputs first, in the order of `model.inputs` (that of the
    # step's batch, which the extracted graph pairs them with): the walk meets
    # them in depth order, and the fingerprint follows the order.
    position = {id(t): k for k, t in enumerate(functional.inputs)}
    inputs = sorted((s for s in sites if s.is_input),
                    key=lambda s: position.get(id(s.output_tensors[0]), len(position)))
    sites = inputs + [s for s in sites if not s.is_input]
    return sites, [refs[id(t)] for t in functional.outputs]


def fingerprint(sites: list[CallSite]) -> str:
    """The `PlanGraph.fingerprint()` of a model with these call sites."""
    return structure_fingerprint((s.id, s.class_name, s.inputs) for s in sites)


def structure_graph(model: Any) -> PlanGraph:
    """A `PlanGraph` of a functional or Sequential model's structure, untraced.

    The rewriter checks plans against it without tracing a step: it has one node
    per call site with its edges, output shapes (unknown dimensions as 1) and the
    model's outputs, but no costs.

    Args:
        model: A built functional or Sequential Keras model.

    Returns:
        A `PlanGraph` whose `fingerprint()` equals that of the extracted graph.
    """
    sites, outputs = walk_with_outputs(model)
    nodes = [Node(id=s.id, layer=s.layer_key, class_name=s.class_name,
                  inputs=list(s.inputs), outputs=[_tensor_info(t) for t in s.output_tensors])
             for s in sites]
    return PlanGraph(nodes=nodes, outputs=outputs, name=model.name)


def _tensor_info(tensor: Any) -> TensorInfo:
    shape = [1 if d is None else d for d in getattr(tensor, "shape", ())]
    return TensorInfo.of(shape, str(getattr(tensor, "dtype", "float32")))
