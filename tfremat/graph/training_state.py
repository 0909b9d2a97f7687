"""Stand-ins for a compiled model's unbuilt training state.

Keras builds a compiled model's optimizer, compiled loss and metrics in the
first training step. A step that tfremat traces (`trace`) or runs
(`tfremat.measure_peak`) and throws away must not build them on the user's
model: variables created while a step is traced live in a graph that never runs
(they stay uninitialised, and a later measurement or `fit` reads them), and a
built optimizer refuses variables it was not built with (a layer unfrozen
later). So the step gets fresh, unbuilt copies, built in its place and dropped
with it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import keras

from tfremat.core import UnsupportedModelError


def fresh_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """An unbuilt copy of an unbuilt optimizer, made from its config.

    Raises:
        UnsupportedModelError: the optimizer does not copy from its config.
    """
    try:
        return type(optimizer).from_config(optimizer.get_config())
    except (TypeError, ValueError) as e:
        raise UnsupportedModelError(
            f"tfremat could not copy the unbuilt optimizer {optimizer.name!r} from its "
            f"config ({e}), and it does not build yours (a built optimizer refuses "
            "variables it was not built with, such as a layer unfrozen later). Build "
            "it first with model.optimizer.build(model.trainable_variables); tfremat "
            "then leaves its state as it was.") from e


@contextlib.contextmanager
def stand_ins(model: keras.Model) -> Iterator[bool]:
    """Puts fresh, unbuilt copies in place of the model's unbuilt training state.

    What the first training step (or `fit`) would build -- an unbuilt optimizer,
    the compiled loss and metrics -- is copied, the copies are put on the model
    (as `compile` assigns them, without tracking), and the originals go back on
    exit. Whoever runs the step builds the copies; the originals stay unbuilt.
    Built state is not copied. The copies are made as Keras 3's `compile` makes
    them (from `_compile_loss` and `_compile_metrics`), in the scope of the
    `tf.distribute` strategy the model was made in (an optimizer copied outside
    it would update `MirroredVariable`s through the default strategy).

    Args:
        model: A Keras model, compiled or not (nothing is replaced if not).

    Yields:
        Whether anything was replaced (and so needs building).

    Raises:
        UnsupportedModelError: the unbuilt optimizer does not copy.
    """
    replacements: dict[str, Any] = {}
    strategy = getattr(model, "distribute_strategy", None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        if getattr(model, "optimizer", None) is not None and model.compiled:
            replacements = _copies(model)
    originals = {name: getattr(model, name) for name in replacements}
    try:
        for name, value in replacements.items():
            object.__setattr__(model, name, value)  # bypasses Keras's and TF's tracking
        yield bool(replacements)
    finally:
        for name, value in originals.items():
            object.__setattr__(model, name, value)


def _copies(model: keras.Model) -> dict[str, Any]:
    """Unbuilt copies of the compiled model's unbuilt training state, by the
    name of the model's attribute each replaces (see `stand_ins`)."""
    replacements: dict[str, Any] = {}
    if not model.optimizer.built:
        replacements["optimizer"] = fresh_optimizer(model.optimizer)
    loss = model._compile_loss
    if loss is not None and not loss.built:
        replacements["_compile_loss"] = type(loss)(
            loss._user_loss, loss._user_loss_weights, reduction=loss.reduction,
            output_names=loss.output_names)
    metrics = model._compile_metrics
    if metrics is not None and not metrics.built:
        replacements["_compile_metrics"] = type(metrics)(
            metrics._user_metrics, metrics._user_weighted_metrics,
            output_names=metrics.output_names)
    return replacements


@contextlib.contextmanager
def forgetting_custom_gradients() -> Iterator[None]:
    """Unregisters the custom gradients that tracing in the block registered.

    TensorFlow registers the gradient function of every `tf.custom_gradient`
    traced into a graph in its global gradient registry, for good, and that
    function keeps the graph and the variables it captured alive. Keras's
    `optimizer.apply` traces one (the all-reduce of the default replica
    context), so the slots of a stand-in optimizer outlived each step traced
    with it: with Adam every `measure_peak` call left about twice the model's
    weights on the device (measured on CPU: 3 calls, 8.6 -> 15.4 -> 20.7 MiB in
    use afterwards; with the entries dropped, 8.6 each time). Use it only
    around steps that are thrown away: nothing may differentiate their graphs
    again. The graphs are then garbage in reference cycles: collect them
    (`gc.collect()`) once the caller has dropped its own references.
    """
    from tensorflow.python.framework import ops  # the registry has no public API

    registry = getattr(getattr(ops, "_gradient_registry", None), "_registry", None)
    before = set(registry) if isinstance(registry, dict) else None
    try:
        yield
    finally:
        if before is not None:
            for name in set(registry) - before:
                if name.startswith("CustomGradient-"):
                    del registry[name]
