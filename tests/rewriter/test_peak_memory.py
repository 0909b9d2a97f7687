"""The measured peak of a training step drops with sqrt(n) recompute segments.

Bounds are loose on purpose (measured: deep MLP 37 -> 19 MB, 29 -> 13 MB with
XLA; ResNet50 at 96x96 batch 16: 280 -> 111 MB; with XLA the peak changes
between compilations, so the smallest of three compilations is compared:
351 -> 240 MB).
"""

from __future__ import annotations

import dataclasses

import keras
import pytest
import tensorflow as tf

from tests.rewriter import rewrite_helpers as h
from tfremat.core import Offload, Segment
from tfremat.graph import step_function
from tfremat.rewriter import PlanInstallation, rewrite_model


def _peaks(model: keras.Model, x, y, jit_compile: bool) -> tuple[int, int]:
    rewritten = rewrite_model(model, h.plan_for(model, h.sqrt_segments(model)))
    compilations = 3 if jit_compile else 1
    return (h.compiled_peak_bytes(model, x, y, jit_compile, compilations),
            h.compiled_peak_bytes(rewritten, x, y, jit_compile, compilations))


@pytest.mark.parametrize("jit_compile", [
    False, pytest.param(True, marks=pytest.mark.slow)])  # XLA: 32 s
def test_deep_mlp_peak_drops(jit_compile):
    keras.utils.set_random_seed(11)
    model = h.deep_mlp(depth=24, width=1024)
    vanilla, recomputed = _peaks(model, tf.random.normal((256, 16)),
                                 tf.random.normal((256, 4)), jit_compile)
    assert recomputed < 0.8 * vanilla, (vanilla, recomputed)


def test_nested_segments_lower_the_peak_of_their_parent():
    # One segment over the whole MLP recomputes everything at once in the
    # backward pass (measured 36 MB, vanilla 35 MB); children recomputed
    # again inside it keep only their inputs (measured 19 MB).
    keras.utils.set_random_seed(13)
    model = h.deep_mlp(depth=24, width=1024)
    ids = h.body_ids(model)[:-1]
    x, y = tf.random.normal((256, 16)), tf.random.normal((256, 4))
    flat = rewrite_model(model, h.plan_for(model, [ids]))
    nested = rewrite_model(model, h.plan_for(model, [
        Segment(ids, children=[Segment(ids[i:i + 5]) for i in range(0, len(ids), 5)])]))
    flat_peak = h.step_peak_bytes(h.training_step(flat, False), x, y)
    nested_peak = h.step_peak_bytes(h.training_step(nested, False), x, y)
    assert nested_peak < 0.8 * flat_peak, (flat_peak, nested_peak)


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile, bound", [(False, 0.6), (True, 0.9)])
def test_resnet50_peak_drops(jit_compile, bound):
    keras.utils.set_random_seed(12)
    model = keras.applications.ResNet50(weights=None, input_shape=(96, 96, 3), classes=10)
    vanilla, recomputed = _peaks(model, tf.random.normal((16, 96, 96, 3)),
                                 tf.random.normal((16, 10)), jit_compile)
    assert recomputed < bound * vanilla, (vanilla, recomputed)


def test_measuring_a_plan_whose_segment_begins_with_an_addition_leaves_no_memory_behind():
    """TensorFlow's tape kept the traced step of such a plan alive (see
    `test_recompute_grad.py`), and with it the stand-in Adam's slots: each
    measurement left twice the segment's weights on the device (19 MiB per
    measurement of a MobileNetV2 whose segment began at a residual `Add`)."""
    inp = keras.Input((64,))
    a, b = keras.layers.Dense(512)(inp), keras.layers.Dense(512)(inp)
    added = keras.layers.Add(name="add")([a, b])
    out = keras.layers.Dense(8)(keras.layers.Dense(2048, name="wide")(added))
    model = keras.Model(inp, out)  # "wide": 4 MiB of weights, Adam's slots 8 MiB
    model.compile(optimizer="adam", loss="mse")
    installation = PlanInstallation(model, h.plan_for(model, [["add", "wide"]]))
    weights = sum(v.numpy().nbytes for v in model.trainable_variables)
    in_use = []
    for _ in range(4):
        installation.measure_peak(batch_size=8)
        in_use.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
    # Leaking, three more calls leave 6x the weights behind.
    assert in_use[3] - in_use[0] < 2 * weights, (in_use, weights)


@pytest.mark.parametrize("unit", ["pinned", "recomputed", "offloaded"])
def test_a_rewritten_step_holds_nothing_once_it_has_run(unit):
    """The tape hands a unit's gradient function zeros for an output nothing
    differentiates (a softmax output: Keras's crossentropy reads its logits),
    and Grappler folded them into a constant the step held for good (5 MiB
    for a U-Net's per-pixel softmax). A pinned plan wraps every unit so; a
    segment holding the output layer too; and so does the unit that reads an
    offloaded tensor (the output layer, reading the ReLU's output from the
    second logical CPU of `tests/conftest.py`)."""
    keras.utils.set_random_seed(17)
    inp = keras.Input((32, 32, 4))
    x = keras.layers.Conv2D(16, 3, padding="same")(inp)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    out = keras.layers.Conv2D(10, 1, activation="softmax", name="output")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
    plan = dataclasses.replace(h.plan_for(model, [["output"]] if unit == "recomputed" else []),
                               pin_order=unit == "pinned")
    devices = {}
    if unit == "offloaded":
        plan.offloaded = [Offload("re_lu:0")]
        devices = {"compute_device": "/CPU:0", "host_device": "/CPU:1"}
    rewritten = rewrite_model(model, plan, **devices)
    rewritten.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
    step = tf.function(step_function(rewritten))
    x = tf.random.normal((16, 32, 32, 4))
    y = tf.one_hot(tf.zeros((16, 32, 32), tf.int32), 10)
    in_use = []
    for _ in range(3):
        in_use.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
        tf.nest.map_structure(lambda t: t.numpy(), step(x, y))
    output_bytes = 16 * 32 * 32 * 10 * 4  # 640 KiB
    assert in_use[2] - in_use[0] < output_bytes // 4, (in_use, output_bytes)
