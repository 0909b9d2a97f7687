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

Keras masks and activation losses cross the unit as well:

- The tensors the unit's function receives carry the Keras masks of the
  unit's inputs, in the forward pass and in the recompute; its outputs carry
  the masks the forward pass made. Masks are boolean: they are bound as
  constants, never differentiated (a unit whose inputs are all boolean takes
  them as arguments, so that its recompute waits for the gradient).
- The losses its layers add during the call (`add_loss`,
  `activity_regularizer`) are extra outputs of the recompute, so their
  gradient flows through its custom gradient. Each replaces, where the layer
  that added it keeps it, the loss the forward pass added, so `model.losses`
  lists it once, attributed to that layer. The recompute adds its
  copies inside its own `StatelessScope`, which discards them.
- The logits Keras caches on a softmax or sigmoid output (`_keras_logits`,
  which `categorical_crossentropy` and `binary_crossentropy` read to compute
  the loss from the logits) are extra outputs of the unit too, cached on its
  outputs as the forward pass cached them inside (`carry_logits`). Without
  them the loss of a unit's softmax output would be computed from the
  clipped probabilities: other rounding, and no gradient where a
  probability is below `keras.config.epsilon()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Iterator, Sequence

import keras
import tensorflow as tf
from keras import tree
from keras.src.backend import (get_keras_mask, get_stateless_scope, in_stateless_scope,
                               set_keras_mask)
from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext

from tfremat.backend import device_name
from tfremat.core import UnsupportedModelError
from tfremat.rewriter.compilers import compiling_units
from tfremat.rewriter.recompute_grad import AfterGrads, keep_grad, recompute_grad


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


def with_masks(tensors: list[Any], masks: Sequence[Any]) -> list[Any]:
    """`tensors`, each given the Keras mask at its position in `masks`.

    Args:
        tensors: Tensors (the recompute's copies of a unit's inputs).
        masks: A mask or None per tensor.

    Returns:
        `tensors` itself, the masks attached.
    """
    for x, mask in zip(tensors, masks):
        if mask is not None:
            set_keras_mask(x, mask)
    return tensors


def call_functional(model: keras.Model, inputs: list[Any], training: bool | None) -> Any:
    """`model(inputs, training=training)` for inputs carrying Keras masks.

    Keras's `__call__` of a functional model warns that the model destroys
    the masks of its inputs, which is wrong: its layers read them. This runs
    the model's `call` in the model's name scope instead (the same operations,
    named as `__call__` names them).

    Args:
        model: A functional model (a segment's or offload unit's sub-model).
        inputs: Its input tensors, with their masks.
        training: The training mode, passed to every layer.

    Returns:
        The model's outputs.
    """
    with keras.name_scope(model.name, caller=model):
        return model.call(inputs, training=training)


def collects_losses() -> bool:
    """Whether a layer's `add_loss` keeps its loss here: always outside a
    `keras.StatelessScope`, inside one only if it collects losses."""
    return not in_stateless_scope() or get_stateless_scope().collect_losses


class AddedLosses:
    """Records the losses that layers add inside a `with` block.

    Args:
        layers: Keras layers; their sublayers are watched too.

    Attributes:
        losses: After the block, each `(layer, loss)` added in it, layers in
            `_flatten_layers` order, each layer's losses in the order added.
    """

    def __init__(self, layers: Sequence[Any]) -> None:
        self._layers = list({id(sub): sub for layer in layers
                             for sub in layer._flatten_layers()}.values())
        self._before: set[int] = set()
        self.losses: list[tuple[Any, Any]] = []

    def _tracked(self) -> list[tuple[Any, Any]]:
        return [(layer, loss) for layer in self._layers for loss in layer._get_own_losses()]

    def __enter__(self) -> "AddedLosses":
        if in_stateless_scope():
            # There a layer owns the scope's losses whose `id` is in its
            # `_loss_ids`, which Keras clears only when a call enters the model.
            # It keeps the ids of losses freed since (a nested segment's
            # recompute adds losses that are gone by the outer one's), and a
            # new loss reusing one was counted as that layer's (seen in CI: a
            # Dense layer's activity-regularizer loss taken for an `add_loss`
            # layer's, and the recompute refused as adding other losses).
            live = {id(loss) for loss in get_stateless_scope().losses}
            for layer in self._layers:
                layer._loss_ids.intersection_update(live)
        self._before = {id(loss) for _, loss in self._tracked()}
        return self

    def __exit__(self, *exc_info: Any) -> None:
        seen = set(self._before)
        for layer, loss in self._tracked():
            if id(loss) not in seen:
                seen.add(id(loss))
                self.losses.append((layer, loss))


def replace_loss(layer: Any, old: Any, new: Any) -> None:
    """Puts `new` where `layer` keeps the loss `old` it added.

    Args:
        layer: A Keras layer.
        old: A loss `layer` added (`add_loss`) in the current scope.
        new: The tensor to stand in its place.
    """
    if in_stateless_scope():
        losses = get_stateless_scope().losses
        layer._loss_ids.discard(id(old))
        layer._loss_ids.add(id(new))
    else:
        losses = layer._losses
    losses[next(k for k, x in enumerate(losses) if x is old)] = new


@contextlib.contextmanager
def inner_call_context() -> Iterator[None]:
    """Runs layer calls as if inside an outer layer's call.

    Keras clears a layer's losses, and its sublayers', when a call enters it
    outside any other layer's call, as a recompute in the backward pass does:
    that would drop the losses of the forward pass from `model.losses`.
    """
    previous = global_state.get_global_attribute("current_call_ctx")
    global_state.set_global_attribute("current_call_ctx", CallContext(entry_layer=None))
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", previous)


def check_same_losses(forward: Sequence[tuple[Any, Any]],
                      again: Sequence[tuple[Any, Any]]) -> None:
    """Raises if a recompute added other losses than the forward pass.

    Raises:
        UnsupportedModelError: the layers adding losses differ, naming them.
    """
    if [id(layer) for layer, _ in forward] != [id(layer) for layer, _ in again]:
        names = sorted({layer.name for layer, _ in [*forward, *again]})
        raise UnsupportedModelError(
            f"Layer(s) {names} added {len(forward)} loss(es) in the forward pass "
            f"but {len(again)} when recomputed; a recompute must add the losses of "
            "the forward pass. Keep these layers outside recompute segments.")


def logits_positions(outputs: Sequence[Any]) -> list[int]:
    """Positions of the tensors in `outputs` carrying cached logits.

    Keras's softmax and sigmoid cache their input on their output
    (`_keras_logits`); Keras's crossentropies compute the loss from it.

    Args:
        outputs: A unit's flat outputs.

    Returns:
        The positions whose tensor carries logits.
    """
    return [k for k, t in enumerate(outputs) if getattr(t, "_keras_logits", None) is not None]


def logits_at(outputs: Sequence[Any], positions: Sequence[int]) -> list[Any]:
    """The cached logits of `outputs` at `positions` (see `logits_positions`).

    Raises:
        UnsupportedModelError: a recompute's output lacks the logits its
            forward pass cached.
    """
    found = [getattr(outputs[k], "_keras_logits", None) for k in positions]
    if any(t is None for t in found):
        raise UnsupportedModelError(
            "A recompute produced a softmax or sigmoid output without the logits its "
            "forward pass cached (`_keras_logits`); a recompute must compute what the "
            "forward pass computed.")
    return found


def carry_logits(outputs: Sequence[Any], positions: Sequence[int],
                 logits: Sequence[Any]) -> None:
    """Caches `logits` on `outputs` at `positions`, as Keras's softmax and
    sigmoid cache theirs, so that a loss on a unit's output reads the unit's
    logits output (and its gradient flows through the unit)."""
    for k, t in zip(positions, logits):
        try:
            outputs[k]._keras_logits = t
        except AttributeError:  # a C-type tensor, as Keras's own softmax allows
            pass


@dataclasses.dataclass
class _Forward:
    """What the forward pass of a recompute unit made."""

    outputs: Any = None
    losses: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    logits: list[int] = dataclasses.field(default_factory=list)


def recompute(fn: Callable[..., Any], inputs: Sequence[Any], layers: Sequence[Any],
              after_grads: AfterGrads | None = None) -> Any:
    """Runs `fn(*inputs)` whose activations are recomputed in the backward pass.

    Args:
        fn: A function of positional tensors only; bind everything else
            (e.g. `training`) in a closure: `checkpoint.recompute_grad` takes
            positional tensors only.
        inputs: The tensors to pass to `fn`. Floating and integer ones are
            the recompute's arguments; boolean ones are bound as constants
            (arguments too when every input is boolean).
            `fn` receives them with their Keras masks.
        layers: The Keras layers `fn` calls. The recompute reads their state
            variables (see `state_variables`) as they were before the forward
            pass and does not assign them. The losses they add are carried
            through the recompute (see the module docstring).
        after_grads: Called in the gradient function once the unit's
            gradients exist (`recompute_grad.recompute_grad`).

    Returns:
        What `fn` returns, with the Keras masks the forward pass attached.

    Raises:
        UnsupportedModelError: the recompute added other losses than the
            forward pass.
    """
    state = state_variables(layers)
    snapshots = [tf.identity(v.value) for v in state]
    compiled = (compiling_units() and not _makes_masks(inputs, layers)
                and not random_on_cpu(layers))
    return _unit(fn, inputs, layers,
                 lambda body: recompute_grad(body, after_grads, compiled=compiled),
                 list(zip(state, snapshots)))


def _makes_masks(inputs: Sequence[Any], layers: Sequence[Any]) -> bool:
    """Whether a unit's outputs may carry Keras masks: an input carries one,
    or one of its layers makes them (`makes_masks`). Such a unit is not
    compiled on its own (`compilers.units_compiled`): the masks its compiled
    forward pass made would be tensors of that program."""
    return any(get_keras_mask(x) is not None for x in inputs) or makes_masks(layers)


def makes_masks(layers: Sequence[Any]) -> bool:
    """Whether one of `layers` (or of their sublayers) makes Keras masks
    (`Embedding(mask_zero=True)`, `Masking`)."""
    return any(getattr(sub, "mask_zero", False) or isinstance(sub, keras.layers.Masking)
               for sub in _sublayers(layers))


def random_on_cpu(layers: Sequence[Any]) -> bool:
    """Whether one of `layers` (or of their sublayers) draws random numbers
    in training (it owns a Keras `SeedGenerator`: `Dropout`, `GaussianNoise`,
    random augmentation) and the step runs on a CPU. Such a unit is not
    compiled on its own (`compilers.units_compiled`): XLA's CPU backend draws
    them slowly in a program of its own (a dropout mask of 32x32x32x32 floats:
    298 ms, 7.4 ms in the executor; a residual CNN with four dropouts in its
    segments stepped in 2.57 s, 0.21 s with them in the executor, 0.32 s
    compiled whole). A GPU's XLA backend is not known to (not run)."""
    return device_name().startswith("CPU") and any(
        _draws_random_numbers(sub) for sub in _sublayers(layers))


def _sublayers(layers: Sequence[Any]) -> Iterator[Any]:
    """`layers` and their sublayers."""
    for layer in layers:
        yield from layer._flatten_layers(include_self=True)


#: Attributes that say how much a layer owning a `SeedGenerator` draws: an RNN
#: cell has one whatever its dropout, and draws nothing at 0.
_RANDOM_AMOUNTS = ("rate", "dropout", "recurrent_dropout", "stddev")


def _draws_random_numbers(layer: Any) -> bool:
    if not getattr(layer, "_seed_generators", None):
        return False
    amounts = [vars(layer)[a] for a in _RANDOM_AMOUNTS
               if isinstance(vars(layer).get(a), (int, float))]
    return not amounts or any(amounts)


def keep(fn: Callable[..., Any], inputs: Sequence[Any], layers: Sequence[Any],
         after_grads: AfterGrads) -> Any:
    """Runs `fn(*inputs)` as one unit of the backward pass, keeping its
    activations: its gradient function differentiates the forward pass's
    recording, then calls `after_grads` (`recompute_grad.keep_grad`).

    Masks and the losses the layers add cross the unit as in `recompute`.

    Args:
        fn: A function of positional tensors only.
        inputs: The tensors to pass to `fn` (see `recompute`).
        layers: The Keras layers `fn` calls.
        after_grads: See `recompute`.

    Returns:
        What `fn` returns, with the Keras masks the forward pass attached.
    """
    return _unit(fn, inputs, layers, lambda body: keep_grad(body, after_grads), [])


def _unit(fn: Callable[..., Any], inputs: Sequence[Any], layers: Sequence[Any],
          gradient: Callable[[Callable[..., Any]], Callable[..., Any]],
          state_mapping: list[tuple[Any, Any]]) -> Any:
    """`fn(*inputs)` under the custom gradient `gradient(body)` makes, with masks
    and losses carried across (see `recompute`); a recompute (a call of the
    body after the first) reads the state of `state_mapping`."""
    values = [tf.convert_to_tensor(x) for x in inputs]
    masks = [get_keras_mask(x) for x in inputs]
    # Floating and integer tensors are arguments of the unit's custom
    # gradient; a recompute waits for the gradient through each: bound as a
    # constant, token ids would let a recompute that starts from them (an
    # Embedding, then an LSTM) run in the forward pass and save nothing.
    # Boolean ones (masks) are bound as constants, what reads them reads an
    # argument too, unless every input is boolean: then they are the arguments.
    arguments = ([i for i, x in enumerate(values) if not x.dtype.is_bool]
                 or list(range(len(values))))
    collect = collects_losses()
    calls = itertools.count()
    forward = _Forward()

    def body(*xs: Any) -> list[Any]:
        args = list(values)
        for i, x in zip(arguments, xs):
            args[i] = x
        with_masks(args, masks)
        if next(calls) == 0:  # The forward pass: state updates are kept.
            with AddedLosses(layers) as added:
                forward.outputs = fn(*args)
            forward.losses = added.losses
            flat = tree.flatten(forward.outputs)
            forward.logits = logits_positions(flat)
            return [*flat, *(loss for _, loss in added.losses),
                    *logits_at(flat, forward.logits)]
        with keras.StatelessScope(state_mapping=state_mapping,
                                  collect_losses=collect), inner_call_context():
            with AddedLosses(layers) as added:
                outputs = fn(*args)
        check_same_losses(forward.losses, added.losses)
        flat = tree.flatten(outputs)
        return [*flat, *(loss for _, loss in added.losses), *logits_at(flat, forward.logits)]

    positional = [values[i] for i in arguments]
    # recompute_grad needs one argument at least: weights' gradients still
    # flow for a unit without inputs.
    results = list(gradient(body)(*(positional or [tf.zeros(())])))
    inner = tree.flatten(forward.outputs)
    n_outputs, n_losses = len(inner), len(forward.losses)
    outputs = results[:n_outputs]
    losses = results[n_outputs:n_outputs + n_losses]
    carry_logits(outputs, forward.logits, results[n_outputs + n_losses:])
    for (layer, old), new in zip(forward.losses, losses):
        replace_loss(layer, old, new)
    for made, out in zip(inner, outputs):
        mask = get_keras_mask(made)
        if mask is not None:
            set_keras_mask(out, mask)
    return tree.pack_sequence_as(forward.outputs, outputs)
