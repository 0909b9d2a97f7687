"""`recompute_grad`: TensorFlow's gradient checkpointing with a dependency that holds.

`tf.recompute_grad` makes the recompute wait for the incoming gradient through
`x + where(g == g, 0, nan)`. Grappler folds `g == g` to true, which removes the
dependency: the recompute may then run as soon as its inputs exist, often in
the forward pass, and the memory saving is lost (measured: a U-Net segment peaked
at 484 MiB against 371 MiB with Grappler off). Here the dependency `dep` is
`min(|g|, 0)`: 0 for every finite gradient, NaN for NaN, and nothing an
optimizer may fold. It reads every output's gradient: `tf.recompute_grad`
waits for the first only, so a segment whose other output feeds a skip
connection recomputed as soon as that early gradient arrived.

Each input reaches the recompute through `IdentityN([x, dep])`, which hands on
`x`'s own buffer once `dep` exists (no copy), marked so that Grappler keeps it.
Under XLA, which ignores the mark, through `x + dep` (a copy XLA's buffer
assignment may reuse): integer inputs (token ids) get a NaN as 0 (cast to an
integer it would be an index of about -2**31, and the recompute's gather would
fail where the step without recompute goes on with NaN gradients), boolean
ones (masks) wait through `x or False`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record

from tfremat.rewriter.compilers import in_xla, keep

#: `after_grads(input_grads, variables, variable_grads)` of a unit's gradient
#: function, returning the input and variable gradients to hand on (e.g. after
#: applying the optimizer's update: `backward_updates.BackwardUpdates`).
AfterGrads = Callable[[list, list, list], tuple[list, list]]


def recompute_grad(f: Callable[..., Any], after_grads: AfterGrads | None = None,
                   compiled: bool = False) -> Callable[..., Any]:
    """Like `tf.recompute_grad(f)`: `f`'s activations are recomputed in backward.

    Args:
        f: A function of positional tensors.
        after_grads: Called with the input gradients, the variables `f` read
            and their gradients once the recompute's gradients exist; what it
            returns is handed on.
        compiled: Compile the forward pass, and the recompute with its
            gradients, each as an XLA program of its own (`after_grads` runs
            outside them); the step around them runs as it is traced.

    Returns:
        A function computing `f` without keeping its intermediate tensors for
        the backward pass, which recomputes them once the gradients of all its
        outputs have arrived.
    """
    forward = tf.function(f, jit_compile=True, autograph=False) if compiled else f

    @tf.custom_gradient
    def inner(*args: Any) -> Any:
        with record.stop_recording():
            result = forward(*args)

        def grad(*dresult: Any, variables: Any = None) -> Any:
            # Wait for every output's gradient, not only the first: a segment
            # whose other output feeds a skip connection gets that gradient early.
            firsts = [tf.cast(tf.reshape(g, [-1])[:1], tf.float32) for g in dresult
                      if g is not None]
            dep = tf.minimum(tf.abs(tf.reduce_max(tf.concat(firsts, 0))), 0.0)
            recompute_args = _after(list(args), dep)
            variables = list(variables or [])
            if compiled:
                grads = _compiled_gradients(f, recompute_args, variables, dresult)
            else:
                grads = _recomputed_gradients(f, recompute_args, variables, dresult)
            input_grads, var_grads = grads[:len(args)], grads[len(args):]
            if after_grads is not None:
                return after_grads(input_grads, variables, var_grads)
            return input_grads, var_grads

        return result, grad

    return inner


def _recomputed_gradients(f: Callable[..., Any], args: list[Any], variables: list[Any],
                          dresult: Sequence[Any]) -> list[Any]:
    """The gradients of `f`'s outputs (each with its incoming gradient in
    `dresult`) with respect to `args` and `variables`, `f` run again."""
    # A tape, not the graph's gradients: those search the graph from each
    # variable, and nested segments call them level by level (ResNet152's
    # `auto` plan traced for more than 7 minutes).
    with tf.GradientTape() as tape:
        tape.watch([x for x in args if x.dtype.is_floating])
        tape.watch(variables)
        outputs = f(*_apart(args))
    return tape_gradients(tape, tf.nest.flatten(outputs), dresult, args + variables)


def _compiled_gradients(f: Callable[..., Any], args: list[Any], variables: list[Any],
                        dresult: Sequence[Any]) -> list[Any]:
    """`_recomputed_gradients` as one XLA program. The incoming gradients
    that are None or zeros by construction (`_flows`) stay outside it: passed
    in, zeros would be differentiated like any gradient."""
    flowing = [k for k, g in enumerate(dresult) if _flows(g)]

    @tf.function(jit_compile=True, autograph=False)
    def recomputed(args: list[Any], gradients: list[Any]) -> list[Any]:
        handed: list[Any] = [None] * len(dresult)
        for k, g in zip(flowing, gradients):
            handed[k] = g
        return _recomputed_gradients(f, args, variables, handed)

    return recomputed(args, [dresult[k] for k in flowing])


def _with_gradients(outputs: list[Any], dresult: Sequence[Any]) -> list[tuple[Any, Any]]:
    """The (output, gradient) pairs of a unit whose gradient is not known zero.

    A tape hands a custom gradient zeros for an output nothing differentiates
    (a softmax output whose loss reads its logits, `_keras_logits`). In a
    graph those zeros have a static shape, and Grappler folds them into a
    constant the step then holds for as long as the model trains (a U-Net's
    per-pixel softmax: 5 MiB); differentiated, they cost a backward pass
    through the output for nothing. Without them the step is as without the
    unit: nothing flows back from that output.

    Args:
        outputs: A unit's flat outputs (the tensors its gradient function
            differentiates).
        dresult: The gradient its gradient function was handed for each.

    Returns:
        `(output, gradient)` for each output whose gradient is neither None
        nor zeros by construction, in order.
    """
    return [(y, dy) for y, dy in zip(outputs, dresult) if _flows(dy)]


def _flows(gradient: Any) -> bool:
    """Whether a gradient handed to a unit is neither None nor zeros by
    construction (`_known_zeros`)."""
    return gradient is not None and not _known_zeros(gradient)


def tape_gradients(tape: tf.GradientTape, outputs: list[Any], dresult: Sequence[Any],
                   sources: list[Any]) -> list[Any]:
    """A unit's gradients from `tape`: of its flat `outputs`, each with its
    incoming gradient in `dresult` (those known zero left out:
    `_with_gradients`), with respect to `sources`, zeros where unconnected,
    sums of more than two terms made two at a time (`summed_in_pairs`).

    Args:
        tape: The tape that recorded the unit's forward pass.
        outputs: The unit's flat outputs.
        dresult: The gradient its gradient function was handed for each.
        sources: The tensors and variables to differentiate with respect to.

    Returns:
        One gradient per source.
    """
    pairs = _with_gradients(outputs, dresult)
    return summed_in_pairs(lambda: tape.gradient(
        [y for y, _ in pairs], sources, output_gradients=[dy for _, dy in pairs],
        unconnected_gradients=tf.UnconnectedGradients.ZERO))


def _graph_gradients(pairs: list[tuple[Any, Any]], args: list[Any],
                     variables: list[Any]) -> tuple[list[Any], list[Any]]:
    """The gradients, from the graph's ops (`tf.gradients`), of the outputs in
    `pairs` (each with its incoming gradient) with respect to the floating
    `args` (None for the others) and to `variables`; None where unconnected.

    The arguments are held constant: a shared weight read before them gets
    this unit's part of its gradient only, as on a tape. Sums of more than
    two gradients are made two at a time (`summed_in_pairs`).
    """
    floating = [k for k, x in enumerate(args) if x.dtype.is_floating]
    sources = [args[k] for k in floating] + variables
    found = summed_in_pairs(lambda: tf.gradients(
        [y for y, _ in pairs], sources, grad_ys=[dy for _, dy in pairs],
        stop_gradients=list(args))) if pairs else [None] * len(sources)
    input_grads: list[Any] = [None] * len(args)
    for k, g in zip(floating, found):
        input_grads[k] = g
    return input_grads, list(found[len(floating):])


def summed_in_pairs(gradient: Callable[[], list[Any]]) -> list[Any]:
    """What `gradient()` returns, with every sum of more than two float
    gradients it made in the graph being built (an `AddN`) made two at a
    time instead.

    A tape, or `tf.gradients`, sums the gradients of a tensor read by more
    than two ops (a batch normalization's input) in one `AddN`. Grappler's
    memory optimizer rewrites such an `AddN` into a temporary variable it
    initialises from zeros, which constant folding turns into a constant the
    step holds for as long as the model trains (16 MiB on a U-Net's plan); a
    sum of two it leaves alone. The terms are added from the left in the
    order Grappler gives an `AddN`'s inputs (sorted by name), which is the
    order the `AddN` adds them in (bit-identical, measured with three and
    five terms), each sum kept from Grappler's arithmetic optimizer (which
    would merge them back into one `AddN`). The `AddN`'s readers read the
    last sum; read by nothing, it is pruned. Eager, or compiled by XLA (which
    ignores the mark and fuses sums its own way), the gradients are returned
    as they are.

    Args:
        gradient: Makes the gradients (a tape's or `tf.gradients`).

    Returns:
        `gradient()`'s list, each summed gradient replaced by its last sum.
    """
    if tf.executing_eagerly() or in_xla():
        return gradient()
    graph = tf.compat.v1.get_default_graph()
    made = len(graph.get_operations())
    grads = gradient()
    replaced = {}
    for op in graph.get_operations()[made:]:
        if op.type != "AddN" or len(op.inputs) <= 2 or not op.outputs[0].dtype.is_floating:
            continue
        terms = sorted(op.inputs, key=_input_name)
        with tf.name_scope(op.name.split("/")[-1] + "_in_pairs"), \
                tf.control_dependencies(op.control_inputs):
            total = terms[0]
            for term in terms[1:]:
                total = keep(tf.math.add_n([total, term]))
        for reader in op.outputs[0].consumers():
            for k, t in enumerate(reader.inputs):
                if t is op.outputs[0]:
                    reader._update_input(k, total)
        replaced[op.outputs[0].ref()] = total
    return [replaced.get(g.ref(), g) if isinstance(g, tf.Tensor) else g for g in grads]


def _input_name(t: tf.Tensor) -> str:
    """How a graph's node names tensor `t` as its input (`op` or `op:k`)."""
    return t.op.name if t.value_index == 0 else f"{t.op.name}:{t.value_index}"


def _known_zeros(t: Any) -> bool:
    """Whether graph tensor `t` is zeros by construction (`tf.zeros`,
    `tf.zeros_like`, a constant of zeros)."""
    if tf.executing_eagerly() or not hasattr(t, "op"):
        return False
    if t.op.type == "ZerosLike":
        return True
    value = tf.get_static_value(t.op.inputs[1] if t.op.type == "Fill" else t) \
        if t.op.type in ("Fill", "Const") else None
    return value is not None and not np.any(value)


def _after(args: list[tf.Tensor], dep: tf.Tensor) -> list[tf.Tensor]:
    """`args`, each available once `dep` (0, or NaN) exists."""
    if not in_xla():
        return [keep(tf.raw_ops.IdentityN(input=[x, dep], name="after_gradients")[0])
                for x in args]
    finite_dep = tf.where(tf.math.is_nan(dep), 0.0, dep)
    return [tf.logical_or(x, tf.cast(finite_dep, tf.bool)) if x.dtype.is_bool
            else x + tf.cast(dep if x.dtype.is_floating else finite_dep, x.dtype)
            for x in args]


def _apart(args: list[tf.Tensor]) -> list[tf.Tensor]:
    """`args` through a reshape each, so that no two get one gradient tensor.

    In a graph, a tape or `tf.gradients` asked for the gradients of sources
    `a` and `b` whose gradient is one tensor (`f` begins with `a + b`, as a
    residual network's `Add` unit does) keeps references to it that are never
    released (TensorFlow 2.21), and with them the whole traced step: measuring
    a plan then left the step and the stand-in optimizer's slots on the device
    (19 MiB per measurement of a MobileNetV2).
    The gradient of a reshape is a tensor of its own; the reshape itself
    copies nothing (its output shares its input's buffer; under XLA it is a
    bitcast).
    """
    if tf.executing_eagerly():
        return args
    return [tf.reshape(x, tf.shape(x)) if x.dtype.is_floating else x for x in args]


def keep_grad(f: Callable[..., Any], after_grads: AfterGrads) -> Callable[..., Any]:
    """`f` with its own gradient function, keeping its activations as usual.

    The gradient function differentiates the forward pass's ops (no
    recompute), then calls `after_grads`, like `recompute_grad`'s. In a graph
    (`tf.function`, how Keras trains) the forward pass runs unrecorded and the
    gradient function takes the graph's gradients (`tf.gradients`): a
    `tf.GradientTape` of its own beside the training step's would make
    TensorFlow wrap every loop of `f` for higher-order gradients, whose
    accumulators then hold a copy of each weight the loop reads at every
    iteration (measured: an LSTM's step 6.5 -> 35 MiB). Run eagerly, and
    under XLA, a tape records the forward pass: XLA fuses the graph's
    gradients differently from the tape's, and Adam turns that rounding on
    weights whose gradient is ~0 into a difference from plain XLA training
    (2.6e-4 relative after 3 steps of a residual CNN, bit-identical with the
    tape); the cost there is XLA's copy of a looped weight per iteration.

    Args:
        f: A function of positional tensors.
        after_grads: See `recompute_grad`.

    Returns:
        A function computing `f`.
    """

    @tf.custom_gradient
    def inner(*args: Any) -> Any:
        if not tf.executing_eagerly() and not in_xla():
            with record.stop_recording():
                result = f(*_apart(list(args)))

            def graph_grad(*dresult: Any, variables: Any = None) -> Any:
                variables = list(variables or [])
                pairs = _with_gradients(tf.nest.flatten(result), dresult)
                input_grads, var_grads = _graph_gradients(pairs, list(args), variables)
                return after_grads(input_grads, variables, var_grads)

            return result, graph_grad

        with tf.GradientTape() as tape:
            tape.watch([x for x in args if x.dtype.is_floating])
            result = f(*_apart(list(args)))

        def grad(*dresult: Any, variables: Any = None) -> Any:
            variables = list(variables or [])
            grads = tape.gradient(result, list(args) + variables,
                                  output_gradients=list(dresult))
            return after_grads(grads[:len(args)], variables, grads[len(args):])

        return result, grad

    return inner
