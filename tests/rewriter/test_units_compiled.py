"""Under XLA a plan's recompute segments compile on their own (`units_compiled`).

Their gradients are checked in test_gradients_match.py; here, which units
compile, and that a plan installed on a model compiled with `jit_compile=True`
runs its step this way.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.rewriter import rewrite_helpers as h
from tfremat.core import Offload
from tfremat.rewriter import PlanInstallation, exact_recompute, rewrite_model, units_compiled
from tfremat.rewriter import install as install_module


@pytest.fixture
def random_units_compile(monkeypatch):
    """Units drawing random numbers (the test models' dropout) compile on their
    own, as where XLA draws them fast; on a CPU they run in the executor
    (`test_a_unit_drawing_random_numbers_runs_without_xla_on_a_cpu`)."""
    monkeypatch.setattr(exact_recompute, "random_on_cpu", lambda layers: False)


def _compiled_calls(model: keras.Model, x, *, within: bool, jit_compile: bool = False) -> int:
    """Calls of functions XLA must compile in the traced gradient step of `model`."""

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nest.flatten(model(x, training=True))[0])
        return tape.gradient(loss, model.trainable_variables)

    function = tf.function(step, jit_compile=jit_compile)
    spec = tf.TensorSpec(x.shape, tf.as_dtype(x.dtype))
    if within:
        with units_compiled():
            graph = function.get_concrete_function(spec).graph
    else:
        graph = function.get_concrete_function(spec).graph
    calls = [op for op in graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    return sum(1 for op in calls if op.node_def.attr["_XlaMustCompile"].b)


def test_each_segment_compiles_its_forward_pass_and_its_recompute_with_xla(random_units_compile):
    model = h.residual_cnn()
    segments = h.sqrt_segments(model)
    rewritten = rewrite_model(model, h.plan_for(model, segments))
    x = h.batch_for(model)
    assert len(segments) > 1
    assert _compiled_calls(rewritten, x, within=True) == 2 * len(segments)
    assert _compiled_calls(rewritten, x, within=False) == 0
    # A step XLA compiles whole compiles its units with it.
    assert _compiled_calls(rewritten, x, within=True, jit_compile=True) == 0


def test_a_unit_whose_outputs_carry_keras_masks_is_not_compiled_on_its_own():
    inp = keras.Input((6,), dtype="int32")
    h_ = keras.layers.Embedding(50, 8, mask_zero=True)(inp)
    h_ = keras.layers.LSTM(8, return_sequences=True)(h_)
    out = keras.layers.Dense(2)(keras.layers.LSTM(8)(h_))
    model = keras.Model(inp, out)
    ids = h.body_ids(model)
    x = np.array([[3, 4, 5, 0, 0, 0], [7, 8, 9, 10, 0, 0]], "int32")
    masked = rewrite_model(model, h.plan_for(model, [ids[:2], ids[2:3]]))
    # The Embedding's unit makes the mask, the first LSTM's reads it.
    assert _compiled_calls(masked, x, within=True) == 0


@pytest.mark.parametrize("build", ["_cnn", "_transformer"])
def test_subclassed_models_units_compile_and_match_the_step_without_xla(
        build, random_units_compile):
    from tests.rewriter import test_subclassed as subclassed

    keras.utils.set_random_seed(6)
    model, x = getattr(subclassed, build)()
    for layer in model._flatten_layers():
        if isinstance(vars(layer).get("rate"), float):  # dropout: see test_gradients_match
            layer.rate = 0.0
    blocks = model.blocks if hasattr(model, "blocks") else model._encoders
    rewritten = rewrite_model(model, subclassed._plan(model, x, [b.name for b in blocks[:2]]),
                              sample=x)
    assert _compiled_calls(rewritten, x, within=True) == 4
    h.assert_same_step(model, rewritten, x, "units", original_mode="function")


def _compiled_cnn(jit_compile: bool) -> keras.Model:
    keras.utils.set_random_seed(3)
    model = h.residual_cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=jit_compile)
    return model


@pytest.mark.parametrize("jit_compile", [True, False])
def test_a_plan_installed_under_xla_compiles_its_segments_and_trains(
        jit_compile, random_units_compile):
    model = _compiled_cnn(jit_compile)
    x = h.batch_for(model, batch=4)
    y = np.zeros((4, 5), "float32")
    installation = PlanInstallation(model, h.plan_for(model, h.sqrt_segments(model)))
    assert installation.units_compiled is jit_compile
    before = [w.copy() for w in model.get_weights()]
    with installation:
        model.fit(x, y, epochs=1, verbose=0)
        planned = installation._planned
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert model.jit_compile is jit_compile  # the model's own setting is kept
    # Two XLA programs per segment (its forward pass, its recompute with its
    # gradients) in the step that ran, none around them.
    segments = len(installation.plan.segments)
    assert _xla_calls(planned) == (2 * segments if jit_compile else 0)


def _xla_calls(train_function) -> int:
    """Calls of functions XLA must compile anywhere in what Keras's
    `train_function` traced: the `tf.function` it runs on an iterator (its
    closure's), its graph and the functions that graph calls."""
    traced = [c.cell_contents for c in train_function.__closure__
              if hasattr(c.cell_contents, "_list_all_concrete_functions")]
    assert traced, "no tf.function in the train function"
    names = set()
    count = 0
    for function in traced:
        for concrete in function._list_all_concrete_functions():
            graph_def = concrete.graph.as_graph_def()
            functions = [f for f in graph_def.library.function if f.signature.name not in names]
            names.update(f.signature.name for f in functions)
            nodes = [*graph_def.node, *(n for f in functions for n in f.node_def)]
            count += sum(1 for n in nodes if n.attr["_XlaMustCompile"].b)
    return count


def test_a_plan_without_segments_or_with_offload_keeps_the_step_as_compiled(monkeypatch):
    model = _compiled_cnn(True)
    ids = h.body_ids(model)
    assert not PlanInstallation(model, h.plan_for(model, [])).units_compiled
    real_rewrite = install_module.rewrite_model  # offload to the second logical CPU
    monkeypatch.setattr(install_module, "rewrite_model", lambda m, p, **kw: real_rewrite(
        m, p, compute_device="/CPU:0", host_device="/CPU:1", **kw))
    offloading = h.plan_for(model, [ids[1:4]])
    offloading.offloaded = [Offload(f"{ids[0]}:0")]
    installation = PlanInstallation(model, offloading, jit_compile=False)
    assert not installation.units_compiled and installation.jit_compile is False


def _keras_function(train_function):
    """The function Keras made, inside the one `train_units_compiled_under_xla`
    runs it from."""
    inner = [c.cell_contents for c in train_function.__closure__
             if callable(c.cell_contents) and getattr(c.cell_contents, "__closure__", None)]
    assert len(inner) == 1, inner
    return inner[0]


def test_a_model_made_by_tfremat_rewrite_compiles_its_segments_under_xla_and_trains_as_installed(
        random_units_compile):
    """`tfremat.rewrite`'s model compiled with `jit_compile=True` (Keras's default
    with a GPU) trains as the Planner runs the plan: two XLA programs per
    segment, none around them, and the weights of the installed plan."""
    import tfremat

    x = h.batch_for(_compiled_cnn(True), batch=4)
    y = np.random.default_rng(1).standard_normal((4, 5)).astype("float32")
    weights = []
    for way in ("rewrite", "installed"):
        model = _compiled_cnn(True)
        plan = h.plan_for(model, h.sqrt_segments(model))
        if way == "rewrite":
            smaller = tfremat.rewrite(model, plan)
            smaller.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=True)
            smaller.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False)
            assert smaller.jit_compile is True
            assert _xla_calls(_keras_function(smaller.train_function)) == 2 * len(plan.segments)
        else:
            with PlanInstallation(model, plan):
                model.fit(x, y, batch_size=2, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_rewritten_model_without_xla_or_with_offload_makes_its_step_as_keras_does():
    import tfremat

    model = _compiled_cnn(False)
    x = h.batch_for(model, batch=4)
    y = np.zeros((4, 5), "float32")
    smaller = tfremat.rewrite(model, h.plan_for(model, h.sqrt_segments(model)))
    smaller.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    smaller.fit(x, y, epochs=1, verbose=0)
    assert _xla_calls(smaller.train_function) == 0  # Keras's own function
    ids = h.body_ids(model)
    offloading = h.plan_for(model, [ids[1:4]])
    offloading.offloaded = [Offload(f"{ids[0]}:0")]
    offloaded = tfremat.rewrite(model, offloading, compute_device="/CPU:0",
                                host_device="/CPU:1")
    assert "make_train_function" not in vars(offloaded)


def test_measure_peak_traces_a_rewritten_models_step_as_it_trains(monkeypatch):
    """`tfremat.measure_peak` of a model `tfremat.rewrite` made, compiled with
    XLA, measures the step it trains: segments compiled on their own, not the
    step compiled whole; the original's step stays compiled whole."""
    import tfremat
    from tfremat import memory
    from tfremat.rewriter import compilers

    real = memory._trace_and_measure
    seen = []

    def spy(model, x, x_spec, given, candidates, jit, repeats):
        seen.append((jit, compilers._UNITS_COMPILED.get()))
        return real(model, x, x_spec, given, candidates, jit, repeats)

    monkeypatch.setattr(memory, "_trace_and_measure", spy)
    model = _compiled_cnn(True)
    smaller = tfremat.rewrite(model, h.plan_for(model, h.sqrt_segments(model)))
    smaller.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=True)
    for measured in (model, smaller):
        assert tfremat.measure_peak(measured, batch_size=4) > 0
    assert seen == [(True, False), (False, True)]
    assert not compilers._UNITS_COMPILED.get()


def test_a_unit_drawing_random_numbers_runs_without_xla_on_a_cpu():
    """XLA's CPU backend drew a dropout mask 40 times slower in a program of its
    own than the executor does: such a unit stays in the executor there, the
    others compile on their own."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", name="c0")(inp)
    x = keras.layers.Dropout(0.2, name="drop")(keras.layers.ReLU(name="r0")(x))
    x = keras.layers.Conv2D(4, 3, padding="same", name="c1")(x)
    x = keras.layers.ReLU(name="r1")(x)
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(
        keras.layers.GlobalAveragePooling2D(name="pool")(x)))
    x = h.batch_for(model)
    rewritten = rewrite_model(model, h.plan_for(model, [["c0", "r0", "drop"], ["c1", "r1"]]))
    assert _compiled_calls(rewritten, x, within=True) == 2  # the second segment only


@pytest.mark.parametrize("dropout, compiled", [(0.0, 2), (0.2, 0)])
def test_an_rnn_draws_random_numbers_only_with_dropout(dropout, compiled):
    """An RNN cell owns a SeedGenerator whatever its dropout: without dropout
    its unit compiles on its own like any other."""
    inp = keras.Input((6, 5))
    out = keras.layers.Dense(2, name="head")(keras.layers.GRU(4, dropout=dropout, name="gru")(inp))
    model = keras.Model(inp, out)
    rewritten = rewrite_model(model, h.plan_for(model, [["gru"]]))
    assert _compiled_calls(rewritten, h.batch_for(model), within=True) == compiled
