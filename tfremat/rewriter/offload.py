"""The host-offload mechanism: host copies, gated prefetches, offload units.

An offloaded tensor is copied to the host once in the forward pass
(`to_host`). Every call reading it runs as an offload unit (`offload_call`):
a `tf.custom_gradient` whose forward passes the device tensor on and whose
gradient copies the host copy back (`from_host`) and runs the unit's backward
from it under a tape. No backward op reads the device tensor, so it is freed
after its last forward use. Re-running the unit in the backward pass is no
extra compute for Conv2D/Dense: their gradients need only their inputs, so
Grappler prunes the dead re-run; ops whose gradient needs their own output
(ReLU, tanh, BatchNorm's moments) are recomputed.

Two Grappler details (docs/how-it-works.md, "Host offload"): copies are
marked `_grappler_do_not_remove`, else the dependency optimizer removes the
compute -> host -> compute Identity round trip (a copy back is marked only
when the gradient reads it, so that Grappler prunes unread ones, e.g. of an
Add, whose gradient needs no input); and the prefetch gate sits on
the host side (a host identity with a control dependency on the trigger), since
a control dependency on the device-side copy does not delay the transfer.

XLA ignores `tf.device`: inside a `jit_compile=True` function the copies are
plain identities and nothing is offloaded (`offload_call` warns).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import keras
import tensorflow as tf
from keras import tree
from keras.src.backend import get_keras_mask, set_keras_mask

from tfremat.core import warn
from tfremat.rewriter.compilers import in_xla, keep
from tfremat.rewriter.exact_recompute import (AddedLosses, carry_logits, check_same_losses,
                                              collects_losses, inner_call_context,
                                              logits_at, logits_positions, replace_loss,
                                              state_variables, with_masks)
from tfremat.rewriter.recompute_grad import tape_gradients


def to_host(tensor: Any, host_device: str) -> tf.Tensor:
    """A copy of `tensor` placed on `host_device`, kept by Grappler.

    Args:
        tensor: The device tensor.
        host_device: Where the copy lives, e.g. `"/CPU:0"`. On a GPU machine
            TensorFlow places a GPU -> CPU copy in pinned host memory (the
            `gpu_host_bfc` allocator).

    Returns:
        The host copy.
    """
    with tf.device(host_device):
        return keep(tf.identity(tensor, name="offload_to_host"))


def from_host(host_copy: tf.Tensor, compute_device: str,
              trigger: tf.Tensor | None = None) -> tf.Tensor:
    """Copies a host copy back to `compute_device`, after `trigger` if given.

    The copy is not marked for Grappler yet: `keep_if_read` marks it once the
    gradient that should read it is built.

    Args:
        host_copy: The tensor `to_host` made.
        compute_device: Where the copy back lives.
        trigger: A gradient tensor; the copy back starts once it is computed
            (the gate is a host-side identity with a control dependency on it).
            None: the copy back runs when the gradient needing it runs.

    Returns:
        The tensor on `compute_device`.
    """
    source = host_copy
    if trigger is not None:
        with tf.device(host_copy.device or None), tf.control_dependencies([trigger]):
            source = tf.identity(host_copy, name="prefetch_gate")
    with tf.device(compute_device):
        return tf.identity(source, name="prefetch")


def keep_if_read(copies: Sequence[tf.Tensor], results: Sequence[Any]) -> None:
    """Marks for Grappler the copies back (`from_host`) that `results` read.

    A marked copy back stays a device-placed copy (unmarked, Grappler folds it
    into its readers). An unread one (the re-run of an Add, whose gradient
    needs no input) stays unmarked, so Grappler prunes it with its gate.

    Args:
        copies: Tensors `from_host` made.
        results: The gradients computed from them (None entries allowed).
    """
    if tf.executing_eagerly():
        return
    targets = {id(t.op) for t in results if t is not None}
    for copy in copies:
        seen: set[int] = set()
        stack = [copy.op]
        while stack:
            op = stack.pop()
            if id(op) in targets:
                keep(copy)
                if copy.op.inputs[0].op.name.endswith("prefetch_gate"):
                    keep(copy.op.inputs[0])
                break
            for out in op.outputs:
                for reader in out.consumers():
                    if id(reader) not in seen:
                        seen.add(id(reader))
                        stack.append(reader)


class GradientSignals:
    """The gradients of the prefetch triggers, as the backward pass makes them.

    `tape.gradient` runs gradient functions in reverse layer order, so the
    signal of a trigger that comes later in the forward pass is recorded before
    the gradient of an earlier offload unit asks for it. A signal recorded in
    another graph (an earlier trace) is never returned.
    """

    def __init__(self) -> None:
        self._latest: dict[str, tf.Tensor] = {}

    def record(self, key: str, tensor: tf.Tensor) -> None:
        self._latest[key] = tensor

    def get(self, key: str | None) -> tf.Tensor | None:
        """The latest gradient of trigger `key` in the graph being built
        (None in eager mode, where execution is already ordered)."""
        tensor = self._latest.get(key) if key is not None else None
        if tensor is None or tf.executing_eagerly():
            return None
        return tensor if tensor.graph is tf.compat.v1.get_default_graph() else None


def signal_gradient(inputs: Sequence[Any], signals: GradientSignals, key: str) -> list[Any]:
    """Identity on `inputs` whose gradient is recorded as signal `key`.

    Wrapped around the inputs of a trigger layer call, the recorded tensor is
    the gradient that the trigger's backward produces.

    Args:
        inputs: The trigger call's input tensors.
        signals: Where the gradient is recorded.
        key: The trigger's node id.

    Returns:
        The inputs, floating ones through the identity.
    """
    values = [tf.convert_to_tensor(x) for x in inputs]
    floating = [i for i, x in enumerate(values) if x.dtype.is_floating]
    if not floating:
        return values

    @tf.custom_gradient
    def identity(*xs: tf.Tensor) -> Any:
        def grad(*dys: tf.Tensor) -> list[tf.Tensor]:
            dys = [tf.zeros_like(x) if dy is None else dy for x, dy in zip(xs, dys)]
            # A side identity, off the gradient's data path, so that Grappler
            # fuses the trigger's backward as in the original model.
            signals.record(key, keep(tf.identity(dys[0], name="prefetch_trigger")))
            return dys

        return [tf.identity(x) for x in xs], grad

    passed = identity(*[values[i] for i in floating])
    for i, x in zip(floating, passed):
        values[i] = x
    return values


def offload_call(fn: Callable[..., Any], inputs: Sequence[Any],
                 host_copies: Mapping[int, tf.Tensor], layers: Sequence[Any], *,
                 compute_device: str, signals: GradientSignals,
                 triggers: Mapping[int, str | None]) -> Any:
    """Runs `fn(*inputs)` whose backward reads offloaded inputs from the host.

    The forward pass runs `fn` on `inputs` and keeps nothing of it. The
    gradient copies each offloaded input back from its host copy (after its
    trigger's gradient, see `GradientSignals`), re-runs `fn` under a tape on
    `compute_device`, with the other inputs as they were, and differentiates
    it. The re-run sees the state variables of the forward pass (BatchNorm
    statistics, dropout seeds) and assigns none of them, as in
    `tfremat.rewriter.exact_recompute.recompute`, which also says how Keras
    masks, the losses the layers add and the logits cached on a softmax or
    sigmoid output cross the unit.

    Args:
        fn: A function of positional tensors only (bind `training` in a
            closure: `tf.custom_gradient` refuses keywords in graph mode).
        inputs: The device tensors to pass to `fn`, with their Keras masks.
        host_copies: Host copy (`to_host`) of each offloaded input, by
            position in `inputs`.
        layers: The Keras layers `fn` calls.
        compute_device: Where the backward re-run and the copies back run.
        signals: The gradient signals of the prefetch triggers.
        triggers: Trigger node id (or None: just in time) of each offloaded
            input, by position in `inputs`.

    Returns:
        What `fn` returns, with the Keras masks of the forward pass.

    Raises:
        UnsupportedModelError: the re-run added other losses than the forward
            pass.
    """
    if in_xla():
        warn(
            "A host-offload unit is traced inside an XLA-compiled function "
            "(jit_compile=True); XLA ignores tf.device, so nothing is offloaded. "
            "Compile the model with jit_compile=False.")
    state = state_variables(layers)
    snapshots = [tf.identity(v.value) for v in state]
    values = [tf.convert_to_tensor(x) for x in inputs]
    input_masks = [get_keras_mask(x) for x in inputs]
    differentiable = [i for i, x in enumerate(values) if x.dtype.is_floating]
    collect = collects_losses()
    structure: list[Any] = []
    masks: list[Any] = []
    losses: list[tuple[Any, Any]] = []
    logits: list[int] = []

    def run(args: list[Any]) -> list[Any]:
        outputs = fn(*with_masks(args, input_masks))
        structure[:] = [outputs]
        return tree.flatten(outputs)

    @tf.custom_gradient
    def unit(*xs: tf.Tensor) -> Any:
        args = list(values)
        for i, x in zip(differentiable, xs):
            args[i] = x
        with AddedLosses(layers) as added:
            outputs = run(args)
        losses[:] = added.losses
        masks[:] = [get_keras_mask(t) for t in outputs]
        logits[:] = logits_positions(outputs)

        def grad(*dys: tf.Tensor, variables: Sequence[Any] = ()) -> Any:
            replay = list(args)
            for i, host in host_copies.items():
                replay[i] = from_host(host, compute_device, signals.get(triggers[i]))
            watched = [replay[i] for i in differentiable]
            with tf.device(compute_device), tf.GradientTape() as tape:
                tape.watch(watched)
                tape.watch(list(variables))
                with keras.StatelessScope(state_mapping=list(zip(state, snapshots)),
                                          collect_losses=collect), inner_call_context():
                    with AddedLosses(layers) as added_again:
                        again = run(replay)
                check_same_losses(losses, added_again.losses)
                again += [loss for _, loss in added_again.losses] + logits_at(again, logits)
                grads = tape_gradients(tape, again, dys, watched + list(variables))
            keep_if_read([replay[i] for i in host_copies], grads)
            input_grads = grads[:len(watched)] or [tf.zeros(())]
            return input_grads, grads[len(watched):]

        return [tf.identity(t) for t in [*outputs, *(loss for _, loss in losses),
                                         *logits_at(outputs, logits)]], grad

    # tf.custom_gradient needs one argument at least (all inputs integer).
    flat = list(unit(*([values[i] for i in differentiable] or [tf.zeros(())])))
    outputs = flat[:len(masks)]
    added_losses = flat[len(masks):len(masks) + len(losses)]
    carry_logits(outputs, logits, flat[len(masks) + len(losses):])
    for (layer, old), new in zip(losses, added_losses):
        replace_loss(layer, old, new)
    for t, mask in zip(outputs, masks):
        if mask is not None:
            set_keras_mask(t, mask)
    return tree.pack_sequence_as(structure[0], outputs)

