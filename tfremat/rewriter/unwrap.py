"""`unwrapped`: the model a rewritten model was made from, to plan it again.

A model `rewrite_model` returned (or one loaded from its `.keras` file) runs
its recompute segments, update units and offload units as single layers. Its
graph, extracted as it is, holds each unit as one call whose backward pass
holds all it recomputes, so its plans are predicted high. Unwrapped, each unit
is replaced by the layer calls inside it: the same layer objects and weights,
the call sites (and node ids) of the model it was rewritten from, so a plan for
one is a plan for the other.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import tree

from tfremat.graph import as_functional, is_subclassed
from tfremat.rewriter.functional import REWRITTEN_SUFFIX, of_own_class
from tfremat.rewriter.offload_layers import GradientSignal, HostCopy, OffloadUnit
from tfremat.rewriter.segment_layer import RecomputeSegment
from tfremat.rewriter.submodel_layer import SubmodelLayer
from tfremat.rewriter.update_layer import UpdateUnit

#: The class names of the layers a rewrite makes, as an extracted graph names them.
UNIT_CLASSES = tuple(c.__name__ for c in (RecomputeSegment, UpdateUnit, OffloadUnit))


def unwrapped(model: keras.Model, *, compiled: bool = False) -> keras.Model:
    """The model `model` was rewritten from, sharing its layers and weights.

    Each `RecomputeSegment`, `UpdateUnit` and `OffloadUnit` is replaced by the
    calls of its sub-model (nested segments too), each `GradientSignal` and
    `HostCopy` by its inputs, and an `Identity` that gave a model output back
    the name of the layer making it inside a unit is left out. The result has
    `model`'s inputs and outputs, and its class when that class has its own
    training methods (as `rewrite_model` keeps it).

    Args:
        model: A Keras model.
        compiled: Compile the result as `model` is compiled (its compile
            configuration, with `model`'s own optimizer object, whose
            variables are the same weights' slots), to trace its training step.

    Returns:
        The unwrapped model, or `model` itself when it has no units (tfremat
        did not rewrite it, or it is subclassed: a subclassed model's rewrite
        keeps its own sublayers).

    Example:

    ```python
    smaller = tfremat.rewrite(model, budget_mb=6000)
    again = unwrapped(smaller)   # model's layer calls, no units
    ```
    """
    if is_subclassed(model) or not unit_layers(model):
        return model

    def call(layer: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(layer, SubmodelLayer):
            return inlined(layer.submodel, args[0])
        if isinstance(layer, OffloadUnit):
            on_device = list(args[0])[:len(args[0]) - len(layer.offloaded)]
            return inlined(layer.submodel, on_device)
        if isinstance(layer, (GradientSignal, HostCopy)):
            return args[0]
        if isinstance(layer, keras.layers.Identity) and _made_by(args[0]) == layer.name:
            return args[0]
        return layer(*args, **kwargs)

    def inlined(submodel: keras.Model, inputs: Any) -> Any:
        return submodel._run_through_graph(list(inputs), operation_fn=lambda op: op,
                                           call_fn=call)

    functional = as_functional(model)
    # Inputs named after the input layers, as the model's own are.
    inputs = tree.map_structure(
        lambda x: keras.Input(batch_shape=x.shape, dtype=x.dtype, sparse=x.sparse,
                              name=_made_by(x)), functional._inputs_struct)
    outputs = functional._run_through_graph(inputs, operation_fn=lambda op: op, call_fn=call)
    original = of_own_class(model, keras.Model(
        inputs, outputs, name=model.name.removesuffix(REWRITTEN_SUFFIX)))
    if compiled and model.compiled:
        original.compile(**_compile_arguments(model))
    return original


def _compile_arguments(model: keras.Model) -> dict[str, Any]:
    """The arguments `model` was compiled with, its optimizer the object itself:
    its loss and metrics made again from their configuration (as loading a
    `.keras` file does), or given as they were when that fails (a custom loss
    Keras cannot make from its name here)."""
    try:
        config = keras.saving.deserialize_keras_object(model.get_compile_config())
    except Exception:  # whatever failed: the objects as given
        config = dict(model._compile_config.config)
    return {**config, "optimizer": model.optimizer}


def _made_by(tensor: Any) -> str | None:
    """The name of the operation that made a symbolic tensor."""
    history = getattr(tensor, "_keras_history", None)
    return history.operation.name if history is not None else None


def unit_layers(model: keras.Model) -> list[str]:
    """The names of the layers of `model` that a rewrite made: recompute
    segments, update and offload units (a model `rewrite_model` returned, or
    one loaded from its `.keras` file).

    Args:
        model: A Keras model.

    Returns:
        Their names, in `model`'s layer order; empty for a model tfremat did
        not rewrite.
    """
    return [layer.name for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, (SubmodelLayer, OffloadUnit))]
