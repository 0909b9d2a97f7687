"""The recompute waits for the incoming gradient: with gradients that are not
finite, from integer or boolean inputs, and after Grappler."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.grappler import tf_optimizer

from tfremat.graph import forgetting_custom_gradients
from tfremat.rewriter import exact_recompute
from tfremat.rewriter.recompute_grad import keep_grad, recompute_grad

TABLE = tf.Variable(np.arange(12, dtype="float32").reshape(6, 2))


def lookup(ids: tf.Tensor) -> tf.Tensor:
    return tf.gather(TABLE, ids) * 2.0


def gradients(fn, ids: tf.Tensor, upstream: float) -> tf.Tensor:
    with tf.GradientTape() as tape:
        out = fn(ids)
    return tape.gradient(out, TABLE, output_gradients=tf.fill(out.shape, upstream))


def test_a_nan_gradient_reaches_the_weights_as_without_recompute():
    ids = tf.constant([1, 4, 4], dtype=tf.int32)
    plain = tf.convert_to_tensor(gradients(lookup, ids, float("nan")))
    # Integer inputs must not receive the NaN through the recompute's wait:
    # cast to an integer it is an index of about -2**31, and the gather fails.
    recomputed = tf.convert_to_tensor(gradients(recompute_grad(lookup), ids, float("nan")))
    np.testing.assert_array_equal(np.isnan(recomputed), np.isnan(plain))


def test_finite_gradients_are_those_without_recompute():
    ids = tf.constant([0, 5, 2, 2], dtype=tf.int32)
    plain = tf.convert_to_tensor(gradients(lookup, ids, 1.5))
    recomputed = tf.convert_to_tensor(gradients(recompute_grad(lookup), ids, 1.5))
    np.testing.assert_array_equal(recomputed, plain)


def recompute_step(fn, layers: list, x: tf.TensorSpec, upstream: tf.TensorSpec,
                   jit_compile: bool = False):
    """The concrete function of one recompute of `fn` over `x` and the
    gradients of `layers`' weights given the output's gradient `upstream`."""

    def step(inputs, output_gradient):
        with tf.GradientTape() as tape:
            out = exact_recompute.recompute(fn, [inputs], layers)
        return tape.gradient(out, [v for layer in layers for v in layer.trainable_variables],
                             output_gradients=output_gradient)

    return tf.function(step, jit_compile=jit_compile).get_concrete_function(x, upstream)


def _ancestors(tensor: tf.Tensor) -> set[str]:
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op.name not in seen:
            seen.add(op.name)
            todo.extend(t.op for t in op.inputs)
            todo.extend(op.control_inputs)
    return seen


def test_a_unit_fed_only_token_ids_recomputes_after_its_gradient_arrives():
    # Bound as constants, the ids let the whole recompute (gather, dense) run
    # in the forward pass, keeping what it was meant to drop.
    embed, dense = keras.layers.Embedding(6, 4), keras.layers.Dense(3)
    graph = recompute_step(lambda t: dense(embed(t)), [embed, dense],
                           tf.TensorSpec((2, 5), tf.int32), tf.TensorSpec((2, 5, 3))).graph
    upstream = graph.inputs[1].op.name
    gathers = [op for op in graph.get_operations() if "Gather" in op.type]
    waiting = [op for op in gathers if upstream in _ancestors(op.outputs[0])]
    assert len(gathers) == 2 and len(waiting) == 1, [op.name for op in gathers]


def test_a_unit_fed_only_a_boolean_mask_recomputes_after_its_gradient_arrives():
    # With a dummy argument instead of the mask, nothing in the recompute read
    # an argument: it ran in the forward pass.
    dense = keras.layers.Dense(3)
    graph = recompute_step(lambda m: dense(tf.cast(m, tf.float32)), [dense],
                           tf.TensorSpec((2, 5), tf.bool), tf.TensorSpec((2, 3))).graph
    upstream = graph.inputs[1].op.name
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    waiting = [op for op in matmuls if upstream in _ancestors(op.outputs[0])]
    # The forward matmul, the recomputed one and the kernel's gradient matmul:
    # the last two wait for the gradient.
    assert len(matmuls) == 3 and len(waiting) == 2, [op.name for op in matmuls]


def test_the_recompute_reads_its_input_uncopied_and_waits_after_grappler():
    """The input reaches the recompute through an `IdentityN` with the
    gradient's dependency: no copy. Unmarked, Grappler removes it with the
    dependency, and the recompute may run in the forward pass."""
    first, second = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(8)
    concrete = recompute_step(lambda t: second(first(t)), [first, second],
                              tf.TensorSpec((4, 8)), tf.TensorSpec((4, 8)))
    graph = concrete.graph
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
    meta.collection_def["train_op"].node_list.value.extend(
        [t.op.name for t in concrete.outputs])
    optimized = {n.name: n for n in tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta).node}
    [after] = [n for n in optimized.values() if n.op == "IdentityN"]
    x, upstream = (t.op.name for t in graph.inputs[:2])
    assert after.input[0] == x  # the input itself: IdentityN hands its buffer on
    assert upstream in _ancestor_names(optimized, after.input[1])
    # The recomputed ReLU reads it (the forward one is pruned: nothing reads it).
    [relu] = [n for n in optimized.values() if n.op == "Relu"]
    assert after.name in _ancestor_names(optimized, relu.name)


def _ancestor_names(nodes: dict, name: str) -> set[str]:
    """Names of the node `name` and its ancestors in an optimised GraphDef."""
    seen, todo = set(), [name]
    while todo:
        name = todo.pop().lstrip("^").split(":")[0]
        if name not in seen:
            seen.add(name)
            todo.extend(nodes[name].input)
    return seen


def test_under_xla_the_recompute_waits_through_an_addition():
    """XLA ignores Grappler's mark and would drop an `IdentityN`'s unread
    input: there the dependency is data, `x + dep`."""
    dense = keras.layers.Dense(8)
    for jit, kind in [(False, "IdentityN"), (True, "AddV2")]:
        graph = recompute_step(dense, [dense], tf.TensorSpec((4, 8)), tf.TensorSpec((4, 8)),
                               jit_compile=jit).graph
        x, upstream = (t.op.name for t in graph.inputs[:2])
        ops = graph.get_operations()
        waiting = [op for op in ops if op.type == kind and x in {t.op.name for t in op.inputs}
                   and upstream in _ancestors(op.outputs[0])]
        assert len(waiting) == 1, (jit, [op.name for op in ops])
        assert any(op.name.startswith("after_gradients") for op in ops) == (not jit)


def test_a_kept_unit_with_a_loop_holds_no_copy_of_its_weights_per_iteration():
    """`keep_grad` (the units of updates in the backward pass and of a pinned
    order) under a training tape: with a tape of its own, TensorFlow wrapped the
    loop for higher-order gradients and held a copy of the weight the loop reads
    at every iteration (an LSTM's step 6.5 -> 35 MiB; here 64 x 4 MiB)."""
    weight = tf.Variable(tf.random.stateless_normal((1024, 1024), [1, 2]) * 0.03)

    def loop(x):
        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(h, weight))
        return tf.while_loop(lambda i, h: i < 64, body, (0, x))[1]

    def step_of(fn):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x) ** 2)
            return tape.gradient(loss, [x, weight])
        return step

    def peak_mib(step, x):
        step(x)  # traced and run once
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        grads = step(x)
        return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2**20, grads

    x = tf.random.stateless_normal((16, 1024), [3, 4])
    plain_mib, plain = peak_mib(step_of(loop), x)
    kept_mib, kept = peak_mib(step_of(keep_grad(loop, lambda gi, v, gv: (gi, gv))), x)
    for a, b in zip(kept, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        assert float(tf.norm(b)) > 0
    assert kept_mib < plain_mib + 64, (kept_mib, plain_mib)  # 256 MiB more with the copies


@pytest.mark.parametrize("wrap,jit", [("recompute", False), ("recompute", True),
                                      ("keep", False), ("keep", True)])
def test_a_traced_step_whose_unit_begins_with_an_addition_is_released(wrap, jit):
    """A tape in a graph asked for the gradients of `a` and `b` in `a + b`
    returns one tensor for both and keeps two references to it for good,
    and with them the whole traced step: measuring such a plan left the step
    and the stand-in optimizer's slots on the device (19 MiB per measurement
    of a MobileNetV2). The custom gradients' registrations, which hold the
    graph too, are dropped as `tfremat.measure_peak` drops them."""
    dense = keras.layers.Dense(4)
    dense.build((2, 4))

    def unit(a, b):
        return dense(a + b)

    wrapped = recompute_grad(unit) if wrap == "recompute" else \
        keep_grad(unit, lambda gi, v, gv: (gi, gv))

    def step(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            out = wrapped(a, b)
        return tape.gradient(out, [a, b, *dense.trainable_variables])

    spec = tf.TensorSpec((2, 4))
    function = tf.function(step, jit_compile=jit)
    with forgetting_custom_gradients():
        graph = weakref.ref(function.get_concrete_function(spec, spec).graph)
    del function
    gc.collect()
    assert graph() is None


@pytest.mark.parametrize("kind", ["kept", "recomputed"])
def test_a_unit_sums_its_gradients_two_at_a_time_after_grappler(kind):
    """A tensor read three times gets a sum of three gradients, which
    Grappler's memory optimizer may turn into a temporary variable and a zeros
    constant the step holds for good (16 MiB on a U-Net). Summed two at a
    time, no sum of more than two is left after Grappler (with TensorFlow's
    own sums, one of three). The terms are added in the order Grappler gives
    an `AddN` (by name), so the gradient is bit-identical to that of TensorFlow's
    sums: the tape's for a recomputed unit; for a kept one, which takes the
    graph's gradients (whose names order the terms otherwise), theirs."""

    def unit(x):
        return tf.sin(x) + tf.cos(x) * tf.exp(x)

    def after_grads(input_grads, variables, variable_grads):
        return input_grads, variable_grads

    wrapped = (keep_grad(unit, after_grads) if kind == "kept"
               else recompute_grad(unit, after_grads))

    def step_of(fn):
        def step(x, upstream):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = fn(x)
            return tape.gradient(out, x, output_gradients=upstream)
        return tf.function(step)

    spec = tf.TensorSpec((4, 8))
    concrete = step_of(wrapped).get_concrete_function(spec, spec)
    graph = concrete.graph
    meta = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(), graph=graph)
    meta.collection_def["train_op"].node_list.value.extend(
        [t.op.name for t in concrete.outputs])
    optimized = tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta).node
    sums = {n.name: len([i for i in n.input if not i.startswith("^")])
            for n in optimized if n.op in ("AddN", "AccumulateNV2")}
    assert sums and max(sums.values()) == 2, sums
    x = tf.random.stateless_normal((4, 8), [5, 6])
    upstream = tf.random.stateless_normal((4, 8), [7, 8])
    got = step_of(wrapped)(x, upstream)
    if kind == "recomputed":
        np.testing.assert_array_equal(got, step_of(unit)(x, upstream))
        return
    graphs = tf.function(lambda x, upstream: tf.gradients(unit(x), x, grad_ys=upstream)[0])
    np.testing.assert_array_equal(got, graphs(x, upstream))
    np.testing.assert_allclose(got, step_of(unit)(x, upstream), rtol=1e-6, atol=1e-7)
