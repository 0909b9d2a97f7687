"""The exact recompute mechanism shared by every recompute unit.

`tf.recompute_grad` alone is not exact for Keras layers (docs/how-it-works.md,
"Rewriting"): the
recompute in the backward pass updates BatchNorm moving statistics a second
time and advances `SeedGenerator`s, so dropout draws a new mask and the
gradients are wrong. `recompute` fixes both: it snapshots the unit's state
variables (non-trainable variables, `SeedGenerator` states included) before the
forward pass, and runs the recompute inside a `keras.StatelessScope` mapping
each state variable to its snapshot, so the recompute sees the state the
forward pass saw and its assignments are discarded.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.backend import get_keras_mask, set_keras_mask

from tfremat.core import UnsupportedModelError
from tfremat.rewriter.recompute_grad import recompute_grad


def state_variables(layers: Sequence[Any]) -> list[Any]:
    """The variables a forward pass of `layers` may read and assign.

    Args:
        layers: Keras layers (models included).

    Returns:
        Their non-trainable variables (moving statistics, `SeedGenerator`
        states, ...), each once.
    """
    seen: set[int] = set()
    out = []
    for layer in layers:
        for v in layer.non_trainable_variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def activation_losses(layers: Sequence[Any]) -> int:
    """How many losses `layers` and their sublayers added in their calls."""
    return sum(len(sub._losses) for layer in layers for sub in layer._flatten_layers())


def recompute(fn: Callable[..., Any], inputs: Sequence[Any],
              layers: Sequence[Any]) -> Any:
    """Runs `fn(*inputs)` whose activations are recomputed in the backward pass.

    Args:
        fn: A function of positional tensors only; bind everything else
            (e.g. `training`) in a closure: `checkpoint.recompute_grad` takes
            positional tensors only.
        inputs: The tensors to pass to `fn`. Floating ones are the recompute's
            arguments; integer and boolean ones are bound as constants.
        layers: The Keras layers `fn` calls. The recompute reads their state
            variables (see `state_variables`) as they were before the forward
            pass and does not assign them.

    Returns:
        What `fn` returns, with the Keras masks the forward pass attached.

    Raises:
        UnsupportedModelError: a layer added a loss computed from its
            activations (`add_loss`, `activity_regularizer`): its gradient
            would not flow through the recompute.
    """
    state = state_variables(layers)
    snapshots = [tf.identity(v.value) for v in state]
    values = [tf.convert_to_tensor(x) for x in inputs]
    # Only floating tensors go through recompute_grad (it adds a float
    # dependency to each argument); integer and boolean ones are bound as
    # constants of the recompute.
    differentiable = [i for i, x in enumerate(values) if x.dtype.is_floating]
    calls = itertools.count()
    forward_outputs: list[Any] = []

    def body(*xs: Any) -> Any:
        args = list(values)
        for i, x in zip(differentiable, xs):
            args[i] = x
        if next(calls) == 0:  # The forward pass: state updates are kept.
            losses = activation_losses(layers)
            outputs = fn(*args)
            if activation_losses(layers) != losses:
                raise UnsupportedModelError(
                    f"A layer among {[layer.name for layer in layers]} adds a loss "
                    "computed from its activations (add_loss or activity_regularizer); "
                    "its gradient cannot flow through a recompute. Keep that layer "
                    "outside recompute segments.")
            forward_outputs.extend(tree.flatten(outputs))
            return outputs
        with keras.StatelessScope(state_mapping=list(zip(state, snapshots))):
            return fn(*args)

    positional = [values[i] for i in differentiable]
    # recompute_grad needs one argument at least: weights' gradients still
    # flow when every input is an integer (e.g. token ids into an Embedding).
    outputs = recompute_grad(body)(*(positional or [tf.zeros(())]))
    for inner, outer in zip(forward_outputs, tree.flatten(outputs)):
        mask = get_keras_mask(inner)
        if mask is not None:
            set_keras_mask(outer, mask)
    return outputs
