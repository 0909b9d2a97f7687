"""Host offload: gradients, placement after Grappler, prefetch gates, training.

Runs on the two logical CPUs of `tests/conftest.py`: compute on "/CPU:0",
host copies on "/CPU:1".
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

from tests.rewriter import rewrite_helpers as h
from tfremat.core import PlanValidationError
from tfremat.core import Offload, Segment
from tfremat.rewriter import rewrite_model
from tfremat.rewriter.offload_layers import OffloadUnit

DEVICES = {"compute_device": "/CPU:0", "host_device": "/CPU:1"}

# Conv outputs read by BatchNorm, a tensor read by a conv and an Add, a
# BatchNorm output read by ReLU (re-run in the backward pass), MHA and
# LayerNorm outputs; with and without prefetch triggers.
OFFLOADS = {
    "residual_cnn": [Offload("conv2d:0", prefetch_after="re_lu_1"),
                     Offload("conv2d_1:0", prefetch_after="conv2d_4"),
                     Offload("batch_normalization:0"),
                     Offload("conv2d_3:0")],
    "transformer_block": [Offload("multi_head_attention:0", prefetch_after="dense_1"),
                          Offload("layer_normalization:0", prefetch_after="layer_normalization_1"),
                          Offload("dense:0")],
}
MODELS = {"residual_cnn": h.residual_cnn, "transformer_block": h.transformer_block}


def _offload_plan(model: keras.Model, offloads: list[Offload], segments=()):
    plan = h.plan_for(model, list(segments))
    plan.offloaded = list(offloads)
    return plan


def _assert_bit_identical(model, rewritten, x, mode):
    start = h.snapshot(model)
    outs_a, grads_a = h.train_grads(model, x, mode)
    h.restore(model, start)
    outs_b, grads_b = h.train_grads(rewritten, x, mode)
    h.restore(model, start)
    for k in grads_a:
        np.testing.assert_array_equal(grads_a[k], grads_b[k])
    for p, q in zip(outs_a, outs_b):
        np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_offload_gradients_are_bit_identical(name, mode):
    keras.utils.set_random_seed(5)
    model = MODELS[name]()
    rewritten = rewrite_model(model, _offload_plan(model, OFFLOADS[name]), **DEVICES)
    units = [layer for layer in rewritten.layers if isinstance(layer, OffloadUnit)]
    offloaded = {o.tensor for o in OFFLOADS[name]}
    readers = {s.id for s in h.walk(model) for ref in s.inputs if ref in offloaded}
    assert len(units) == len(readers)
    x = h.batch_for(model)
    h.assert_same_step(model, rewritten, x, mode)
    _assert_bit_identical(model, rewritten, x, mode)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_offloaded_segment_input_is_recomputed_from_the_host_copy(mode):
    keras.utils.set_random_seed(6)
    model = h.residual_cnn()
    ids = h.body_ids(model)
    block = ids[ids.index("conv2d_3"):ids.index("add_1") + 1]
    plan = _offload_plan(model, [Offload("re_lu_1:0", prefetch_after="conv2d_6")],
                         [Segment(block)])
    rewritten = rewrite_model(model, plan, **DEVICES)
    units = [layer for layer in rewritten.layers if isinstance(layer, OffloadUnit)]
    assert [sorted(layer.name for layer in u.submodel.layers[1:]) for u in units
            if len(u.submodel.layers) > 2] == [sorted(block)]
    h.assert_same_step(model, rewritten, h.batch_for(model), mode)


# -- the graph after Grappler ---------------------------------------------------


def _optimized_step_graph(model: keras.Model, x):
    """The post-Grappler graph of a gradient step returning its loss first."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=True)))
        return loss, tape.gradient(loss, model.trainable_variables)

    ctx = context.context()
    ctx.enable_run_metadata()
    ctx.enable_graph_collection()
    try:
        step(x)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
        ctx.disable_run_metadata()
    return max((f.post_optimization_graph for f in metadata.function_graphs),
               key=lambda g: len(g.node))


def _data_inputs(node) -> list[str]:
    return [i.split(":")[0] for i in node.input if not i.startswith("^")]


def _forward_ops(graph) -> set[str]:
    """The ops the loss depends on: the forward pass. Every other op reading
    a forward tensor belongs to the backward pass (re-runs included)."""
    nodes = {n.name: n for n in graph.node}
    [loss] = [n.name for n in graph.node
              if n.op == "_Retval" and n.attr["index"].i == 0]
    seen, stack = set(), [loss]
    while stack:
        for i in _data_inputs(nodes[stack.pop()]):
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def _readers(graph, name: str) -> set[str]:
    return {n.name for n in graph.node if name in _data_inputs(n)}


def test_offload_survives_grappler_and_the_backward_reads_only_host_copies():
    keras.utils.set_random_seed(7)
    model = h.residual_cnn()
    x = h.batch_for(model)
    offloads = OFFLOADS["residual_cnn"]
    rewritten = rewrite_model(model, _offload_plan(model, offloads), **DEVICES)
    graph = _optimized_step_graph(rewritten, x)
    nodes = {n.name: n for n in graph.node}
    forward = _forward_ops(graph)
    copies = [n for n in graph.node if n.name.endswith("/offload_to_host")]
    assert len(copies) == len(offloads)
    for copy in copies:
        assert copy.device.endswith("CPU:1"), copy.device
        [device_tensor] = _data_inputs(copy)
        assert nodes[device_tensor].device.endswith("CPU:0")
        # Only forward ops read the device tensor.
        assert _readers(graph, device_tensor) - {copy.name} <= forward, device_tensor

    # Each host copy is copied back, and the copies back are read by the
    # backward pass only. (Grappler prunes the copy back of a dead re-run,
    # e.g. of the Add reading conv2d:0, whose gradient needs no input.)
    prefetches = [n for n in graph.node
                  if re.fullmatch(r"prefetch(_\d+)?", n.name.split("/")[-1])]
    sources = set()
    for prefetch in prefetches:
        assert prefetch.device.endswith("CPU:0")
        [source] = _data_inputs(prefetch)
        sources.add(_data_inputs(nodes[source])[0] if "prefetch_gate" in source else source)
        readers_back = _readers(graph, prefetch.name)
        assert readers_back and not readers_back & forward, prefetch.name
    assert sources == {copy.name for copy in copies}
    gates = [n for n in graph.node if n.name.split("/")[-1].startswith("prefetch_gate")]
    gated = [p for p in prefetches if "prefetch_gate" in _data_inputs(p)[0]]
    assert gates and len(gates) == len(gated)
    for gate in gates:
        assert gate.device.endswith("CPU:1")
        [trigger] = [i[1:] for i in gate.input if i.startswith("^")]
        assert trigger.split("/")[-1].startswith("prefetch_trigger")
        assert trigger not in forward and _data_inputs(nodes[trigger])[0] not in forward
        [source] = _data_inputs(gate)
        assert source.endswith("/offload_to_host")


# -- training --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fit_losses_match_original(name):
    keras.utils.set_random_seed(8)
    model = MODELS[name]()
    rewritten = rewrite_model(model, _offload_plan(model, OFFLOADS[name]), **DEVICES)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, *model.input_shape[1:])).astype("float32")
    y = rng.standard_normal((16, *model.output_shape[1:])).astype("float32")
    start = h.snapshot(model)
    histories = []
    for m in (model, rewritten):
        h.restore(model, start)
        m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
        histories.append(m.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                               verbose=0).history["loss"])
    assert len(histories[0]) == 2
    assert histories[0] == histories[1]


# -- refusals ----------------------------------------------------------------------


def test_offload_without_a_second_device_is_refused():
    model = h.residual_cnn()
    plan = _offload_plan(model, [Offload("conv2d_1:0")])
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("a GPU is the default compute device here")
    with pytest.raises(PlanValidationError, match="no separate device"):
        rewrite_model(model, plan)
    with pytest.raises(PlanValidationError, match="two devices"):
        rewrite_model(model, plan, compute_device="/CPU:0", host_device="/cpu:0")


@pytest.mark.parametrize("offload, segments, message", [
    (Offload("conv2d_1:0"), [["conv2d_1", "batch_normalization"]], "not both"),
    (Offload("dense:0"), [], "model output"),
    (Offload("conv2d_1:0", prefetch_after="conv2d"), [], "after its last reader"),
    (Offload("conv2d_1:0", prefetch_after="input_layer"), [], "no floating input"),
])
def test_offloads_the_rewriter_cannot_apply_are_refused(offload, segments, message):
    model = h.residual_cnn()
    with pytest.raises(PlanValidationError, match=message):
        rewrite_model(model, _offload_plan(model, [offload], segments), **DEVICES)


def test_offload_under_xla_warns():
    model = h.residual_cnn()
    rewritten = rewrite_model(model, _offload_plan(model, [Offload("conv2d_1:0")]),
                              **DEVICES)
    with pytest.warns(UserWarning, match="jit_compile=False"):
        h.train_grads(rewritten, h.batch_for(model), "xla")
