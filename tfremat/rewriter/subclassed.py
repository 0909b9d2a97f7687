"""Block-level recompute for subclassed models.

A subclassed model (a `keras.Model` subclass with its own `call`) has no static
graph to rebuild. Its planning units are the calls of its direct sublayers
(held in attributes, or in lists, tuples and dicts held in attributes), as
`tfremat.extract` finds them by tracing a training step: ids `layer.name`, or
`name@k` for the k-th call of a sublayer called more than once. The plan is
checked against that extracted graph. A plan chooses sublayers; each call of a
chosen sublayer is then one exact recompute unit (`tfremat.rewriter.exact_recompute`).

How the user's model stays untouched: the rewritten model is a new object of
the user's class with the user's `call`, made WITHOUT running `__init__` (which
would create new weights) and without `copy.copy` (Keras pickles models on
copy). It starts as a shallow copy of the model's attributes, so it shares the
sublayers and their weights; its own tracking containers (layer and variable
lists, the attribute tracker, TensorFlow's checkpoint dependencies) are copied
so that compiling or training it does not register anything on the original;
its compile state is reset. The attributes that hold chosen sublayers are then
replaced, on the copy only, by `RecomputedCall` proxies: `self.block(x)` in the
user's `call` runs the same sublayer under recomputation, and every other
attribute reads through to the sublayer. Nothing is assigned on the original
model (tracing with `tfremat.extract` shadows sublayers' `call` while it traces
and restores them).

Limits: a chosen sublayer must be reached through an attribute of the model
(directly or in a list/tuple/dict attribute); one reached otherwise (e.g.
through another sublayer) raises `UnsupportedModelError` when the rewrite
checks the calls. The rewritten subclassed model saves as the user's class
(`get_config` is the user's): a loaded copy computes without recompute; apply
the plan again after loading. Nested segments have no meaning at this level:
each chosen call is its own unit.
"""

from __future__ import annotations

import collections
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.backend import any_symbolic_tensors
from keras.src.backend.common import global_state
from keras.src.utils import tracking

from tfremat.core import Plan, UnsupportedModelError, validate_plan
from tfremat.graph import extract
from tfremat.rewriter.backward_updates import BackwardOrder
from tfremat.rewriter.exact_recompute import recompute
from tfremat.rewriter.recompute_grad import AfterGrads


class RecomputedCall:
    """Calls a sublayer under exact recomputation; reads through otherwise.

    Stands in for a sublayer inside a rewritten subclassed model. Its calls
    bind `training` (given, or from Keras's call context) and every
    non-tensor argument in a closure, and pass the tensors to
    `tfremat.rewriter.exact_recompute.recompute`.

    Args:
        layer: The sublayer to recompute.
        after_grads: Called in each call's gradient function once the call's
            gradients exist (a pinned order: `BackwardOrder.after_grads`).
    """

    def __init__(self, layer: keras.layers.Layer,
                 after_grads: AfterGrads | None = None) -> None:
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "after_grads", after_grads)
        object.__setattr__(self, "calls", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"Cannot set {name!r} on the recompute proxy of {self.layer.name!r}: "
            "the rewritten model shares this layer with the original model.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        object.__setattr__(self, "calls", self.calls + 1)
        if any_symbolic_tensors(args, kwargs):
            return self.layer(*args, **kwargs)
        if kwargs.get("training") is None:
            # Bind the training mode of the forward pass: the recompute runs
            # outside any Keras call context. Every layer accepts `training`.
            context = global_state.get_global_attribute("current_call_ctx")
            training = None if context is None else context.get_value("training")
            if training is not None:
                kwargs = {**kwargs, "training": training}
        flat = tree.flatten((args, kwargs))
        where = [i for i, v in enumerate(flat) if tf.is_tensor(v) or isinstance(v, np.ndarray)]

        def run(*tensors: Any) -> Any:
            values = list(flat)
            for i, t in zip(where, tensors):
                values[i] = t
            call_args, call_kwargs = tree.pack_sequence_as((args, kwargs), values)
            return self.layer(*call_args, **call_kwargs)

        return recompute(run, [flat[i] for i in where], [self.layer], self.after_grads)

    def __repr__(self) -> str:
        return f"<RecomputedCall of {self.layer!r}>"


def _model_inputs(model: keras.Model, sample: Any) -> Any:
    """Tensor specs of one input batch of a subclassed model."""
    if sample is not None:
        return tree.map_structure(
            lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(a.dtype)), sample)
    shapes = getattr(model, "_build_shapes_dict", None) or {}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"Cannot tell the input shape of subclassed model {model.name!r} "
            f"(built with {shapes or 'no shapes'}). Pass sample=<one input batch>.")
    shape = next(iter(shapes.values()))
    # `model.build((None, ...))` leaves the batch unknown: a batch of one finds
    # the order of the calls as well.
    return tree.map_shape_structure(
        lambda s: tf.TensorSpec([1 if d is None else d for d in s], model.input_dtype),
        shape)


def _substitute(value: Any, proxies: dict[int, RecomputedCall]) -> Any:
    """`value` with chosen layers replaced by their proxies (copied if changed)."""
    if id(value) in proxies:
        return proxies[id(value)]
    if isinstance(value, (list, tuple)) and any(id(v) in proxies for v in value):
        items = [proxies.get(id(v), v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict) and any(id(v) in proxies for v in value.values()):
        return {k: proxies.get(id(v), v) for k, v in value.items()}
    return value


def _private_containers(model: keras.Model, clone: keras.Model) -> None:
    """Gives `clone` its own copies of the model's mutable bookkeeping and no
    compile state (compile the rewritten model as the original)."""
    for name, value in vars(model).items():
        if isinstance(value, list):
            clone.__dict__[name] = list(value)
        elif isinstance(value, (set, frozenset)):
            clone.__dict__[name] = set(value)
        elif isinstance(value, dict) or type(value).__name__ == "_DictWrapper":
            clone.__dict__[name] = dict(value)
    compiled = {id(model._compile_metrics), id(model._loss_tracker)}
    clone.__dict__["_metrics"] = [m for m in model._metrics if id(m) not in compiled]
    old = model._tracker
    config = {}
    for key, (predicate, store) in old.config.items():
        attr = next(a for a, v in vars(model).items() if v is store)
        config[key] = (predicate, clone.__dict__[attr])
    tracker = tracking.Tracker(config, exclusions=old.exclusions)
    tracker.stored_ids = {k: {i for i in v if i not in compiled}
                          for k, v in old.stored_ids.items()}
    clone.__dict__["_tracker"] = tracker
    for name, value in {
        "compiled": False, "optimizer": None, "loss": None, "_compile_loss": None,
        "_compile_metrics": None, "_loss_tracker": None, "_compile_config": None,
        "train_function": None, "test_function": None, "predict_function": None,
    }.items():
        if name in clone.__dict__:
            clone.__dict__[name] = value


def rewrite_subclassed(model: keras.Model, plan: Plan, sample: Any = None) -> keras.Model:
    """A copy of a subclassed model recomputing the plan's sublayers.

    See the module docstring for how the copy is made without touching the
    user's model, and for its limits. With `plan.pin_order`, each chosen
    call hands its input gradients on only once its weight gradients exist
    (`BackwardOrder`); the other sublayers keep TensorFlow's order.

    Args:
        model: A built subclassed model.
        plan: A plan made for `tfremat.extract(model)`: its segments name
            sublayer call ids of `model`.
        sample: One input batch, when the model's built shapes do not say its
            input (several inputs, integer inputs).

    Returns:
        A new model of the same class, sharing the sublayers and weights,
        uncompiled.

    Raises:
        PlanMismatchError: the plan was made for another model (the plan's
            fingerprint is checked against `tfremat.extract(model)`, which
            traces a training step on a batch of zeros).
        PlanValidationError: the plan is malformed for this model.
        UnsupportedModelError: the model is not built, its input is unknown,
            or a chosen sublayer is not reached through an attribute of the
            model.
    """
    if not model.built:
        raise UnsupportedModelError(
            f"Subclassed model {model.name!r} is not built: call it on a batch first.")
    specs = _model_inputs(model, sample)
    graph = extract(model, sample=tree.map_structure(
        lambda spec: np.zeros(spec.shape, spec.dtype.as_numpy_dtype), specs))
    plan = plan.for_graph(graph)
    validate_plan(plan, graph)
    units = {u.name: u for u in model._flatten_layers(include_self=False, recursive=False)}
    chosen = {graph.node(n).layer for seg in plan.segments for n in seg.nodes}
    after_grads = BackwardOrder().after_grads if plan.pin_order else None
    proxies = {id(units[name]): RecomputedCall(units[name], after_grads) for name in chosen}
    calls = collections.Counter(n.layer for n in graph if n.layer in chosen)
    clone = object.__new__(type(model))
    clone.__dict__.update(vars(model))
    _private_containers(model, clone)
    clone.__dict__["name"] = f"{model.name}_recompute"
    for name, value in vars(model).items():
        # Keras's own layer list keeps the real sublayers (weights, saving).
        if name != "_layers" and not name.startswith("_self_"):
            clone.__dict__[name] = _substitute(value, proxies)
    tf.function(lambda x: clone(x, training=True)).get_concrete_function(specs)
    missed = [p.layer.name for p in proxies.values() if p.calls < calls[p.layer.name]]
    if missed:
        raise UnsupportedModelError(
            f"Sublayer(s) {missed} of {model.name!r} are not called through an attribute "
            "of the model, so they cannot be recomputed. Supported: sublayers held in "
            "attributes of the model, or in lists, tuples or dicts held in attributes; "
            "functional and Sequential models are supported without this limit.")
    return clone
