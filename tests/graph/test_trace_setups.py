"""Everyday compile setups give the PlanGraph of the bare compile.

Metrics, a dict of losses, an optimizer that is not built and a model loaded from
`.keras` all make `tf.function` trace the step twice (the first trace creates
variables); the graph must describe the trace TensorFlow keeps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat.backend import device_name
from tfremat.core import UnsupportedModelError
from tfremat.graph import unbuilt_layers
from tfremat.planners import min_feasible_budget
from tests.graph.test_extract import Blocks
from tests.test_memory import ScaledSGD


def conv_stack(size: int = 16, channels: int = 8, depth: int = 4) -> keras.Model:
    inp = keras.Input((size, size, 3), name="image")
    x = inp
    for i in range(depth):
        x = keras.layers.Conv2D(channels, 3, padding="same", name=f"conv{i}")(x)
        x = keras.layers.ReLU(name=f"relu{i}")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    out = keras.layers.Dense(10, activation="softmax", name="head")(x)
    return keras.Model(inp, out, name="conv_stack")


def two_heads() -> keras.Model:
    inp = keras.Input((16,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="trunk")(inp)
    a = keras.layers.Dense(4, name="a")(h)
    b = keras.layers.Dense(2, activation="tanh", name="b")(h)
    return keras.Model(inp, {"a": a, "b": b}, name="two_heads")


def assert_same_graph(got: tfremat.PlanGraph, want: tfremat.PlanGraph) -> None:
    """The same nodes, reads, FLOPs and simulated peak. Compare graphs extracted
    with `measure_kernels=False`: the kernels' scratch, read on the allocator,
    moves by up to a few tenths of a percent between two extractions of one
    compile (64.0 against 64.2 MiB predicted for the conv stack in CI)."""
    assert [n.id for n in got] == [n.id for n in want]
    for n, m in zip(got, want):
        assert n.backward_reads == m.backward_reads, n.id
        assert n.internal_saved_bytes == m.internal_saved_bytes, n.id
        assert n.flops_forward == m.flops_forward, n.id
        assert n.flops_backward == m.flops_backward, n.id
    peak, want_peak = tfremat.simulate(got).peak_bytes, tfremat.simulate(want).peak_bytes
    assert abs(peak / want_peak - 1) < 1e-3, (peak, want_peak)


@pytest.fixture(scope="module")
def bare_conv_graph() -> tfremat.PlanGraph:
    model = conv_stack()
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    graph = tfremat.extract(model, batch_size=4, measure_kernels=False)
    # The bare graph itself is sound: convolutions read their inputs, ReLUs
    # their outputs, and their gradients cost FLOPs.
    assert graph.node("conv1").backward_reads == ["relu0:0"]
    assert graph.node("relu1").backward_reads == ["relu1:0"]
    assert all(n.flops_backward > 0 for n in graph if not n.is_input)
    return graph


def test_metrics_give_the_bare_graph(bare_conv_graph):
    model = conv_stack()
    model.compile(optimizer="adam", loss="categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC()])
    assert_same_graph(tfremat.extract(model, batch_size=4, measure_kernels=False),
                      bare_conv_graph)


def test_an_unbuilt_optimizer_gives_the_bare_graph(bare_conv_graph):
    model = conv_stack()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="categorical_crossentropy")
    assert not model.optimizer.built
    assert_same_graph(tfremat.extract(model, batch_size=4, measure_kernels=False),
                      bare_conv_graph)


def test_planning_leaves_an_unbuilt_optimizer_unbuilt_so_a_layer_unfrozen_later_trains():
    model = conv_stack()
    model.get_layer("conv0").trainable = False
    optimizer = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=optimizer, loss="categorical_crossentropy")
    graph = tfremat.extract(model, batch_size=4)
    # 64 MiB, or the lowest budget planned for where a filter gradient's
    # scratch (~30 MiB at any size with TensorFlow's own CPU kernels) is more.
    lowest = min_feasible_budget(graph, offload=False) / 2**20
    tfremat.rewrite(model, budget_mb=max(64.0, lowest + 0.1), batch_size=4)
    assert not optimizer.built and len(optimizer.variables) == 2  # iterations, learning rate
    # The graph still counts the slots the step's Adam makes (two per weight).
    weights = graph.persistent_bytes["weights"]
    assert graph.persistent_bytes["optimizer"] >= 2 * weights
    # Built on the frozen model's variables, it would refuse conv0's kernel here.
    model.get_layer("conv0").trainable = True
    model.compile(optimizer=optimizer, loss="categorical_crossentropy")
    x = tf.random.normal((4, 16, 16, 3))
    y = tf.one_hot([1, 2, 3, 4], 10)
    model.fit(x, y, epochs=1, verbose=0)
    assert optimizer.built


def test_planning_leaves_no_optimizer_slots_on_the_device():
    """The stand-in optimizer's slots, held by the traced graph in reference
    cycles, outlived `extract` until Python's collector ran (a user's next fit
    peaked 50% higher with them)."""
    inputs = keras.Input((1024,))
    h = inputs
    for _ in range(3):
        h = keras.layers.Dense(1024)(h)
    model = keras.Model(inputs, h)
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")  # slots: 24 MiB
    device = device_name()
    in_use = tf.config.experimental.get_memory_info(device)["current"]
    tfremat.extract(model, batch_size=8, measure_kernels=False)
    left = tf.config.experimental.get_memory_info(device)["current"] - in_use
    assert left < 2**20, f"{left / 2**20:.1f} MiB left on {device}"


def test_an_unbuilt_optimizer_that_cannot_be_copied_is_refused_untouched_by_planning():
    model = conv_stack()
    model.compile(optimizer=ScaledSGD(0.5), loss="categorical_crossentropy")
    with pytest.raises(UnsupportedModelError, match="Build it first"):
        tfremat.extract(model, batch_size=4)
    assert not model.optimizer.built
    model.optimizer.build(model.trainable_variables)  # what the message advises
    assert tfremat.extract(model, batch_size=4).persistent_bytes["optimizer"] > 0


def test_a_model_loaded_from_keras_file_gives_the_bare_graph(bare_conv_graph, tmp_path):
    model = conv_stack()
    model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    model.save(tmp_path / "m.keras")
    keras.backend.clear_session()
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert_same_graph(tfremat.extract(loaded, batch_size=4, measure_kernels=False),
                      bare_conv_graph)


def test_a_dict_of_weighted_losses_gives_the_bare_graph():
    bare = two_heads()
    bare.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
    want = tfremat.extract(bare, batch_size=4, measure_kernels=False)
    model = two_heads()
    model.compile(optimizer="sgd", loss={"a": "mse", "b": "mean_absolute_error"},
                  loss_weights={"a": 1.0, "b": 0.5}, metrics={"a": ["mae"]})
    got = tfremat.extract(model, batch_size=4, measure_kernels=False)
    assert_same_graph(got, want)
    # Its kernel gradient reads the input; tanh keeps its output.
    assert got.node("b").backward_reads == ["b:0", "trunk:0"]


def test_metrics_leave_room_for_a_plan():
    """Regression: with metrics, every node lost its backward reads, the
    predicted peak fell far below the measured one, and the plan was empty."""
    model = conv_stack(size=32, channels=32)
    model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
    # Tensors only (see `assert_same_graph`).
    graph = tfremat.extract(model, batch_size=8, measure_kernels=False)
    plain = conv_stack(size=32, channels=32)
    plain.compile(optimizer="adam", loss="categorical_crossentropy")
    assert_same_graph(graph, tfremat.extract(plain, batch_size=8, measure_kernels=False))
    with pytest.raises(tfremat.BudgetError) as err:  # the lowest feasible budget
        tfremat.plan(model, budget_mb=0.01, graph=graph)
    budget_mb = (err.value.min_budget_mb + tfremat.simulate(graph).peak_mb) / 2
    plan = tfremat.plan(model, budget_mb=budget_mb, batch_size=8, graph=graph)
    assert plan.segments
    assert tfremat.simulate(graph, plan).peak_mb <= budget_mb


class TwoPasses(keras.Model):
    """A custom train_step that runs the model twice."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            loss += tf.reduce_mean(tf.square(self(2.0 * x, training=True)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_a_step_running_the_model_twice_is_refused():
    base = conv_stack()
    model = TwoPasses(base.inputs, base.outputs)
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
    with pytest.raises(UnsupportedModelError,
                       match=r"calls layer 'conv0' 2 times.*custom train_step"):
        tfremat.extract(model, batch_size=4)


class BuiltByShape(keras.Model):
    """A subclassed model without its own `build()`: `model.build(shape)` marks
    it built and builds none of its layers (Keras warns)."""

    def __init__(self):
        super().__init__()
        self.blocks = [keras.Sequential([keras.layers.Dense(8), keras.layers.ReLU()])
                       for _ in range(2)]
        self.head = keras.layers.Dense(2)

    def call(self, x, training=None):
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(x)


def built_by_shape() -> keras.Model:
    keras.utils.set_random_seed(5)
    model = BuiltByShape()
    with pytest.warns(UserWarning, match="does not have a `build\\(\\)` method"):
        model.build((None, 4))
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    return model


def test_a_sample_with_targets_builds_an_unbuilt_model_as_fit_does():
    """`tfremat.plan(model, ..., sample=(x, y))` refused an unbuilt subclassed
    model ("not built") that the Planner, given the same batch in `fit`,
    builds, and a model whose `build(shape)` left its layers unbuilt (naming
    them and `model(x[:1])` as the way out); both build them now, as `fit`
    does."""
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    half_built = built_by_shape()
    graph = tfremat.extract(half_built, sample=(x, y))
    assert not unbuilt_layers(half_built) and len(graph) > 2
    model = Blocks()
    model.compile(optimizer="adam", loss="mse")
    plan = tfremat.plan(model, 50, sample=(np.ones((8, 16), "float32"),
                                           np.ones((8, 1), "float32")))
    assert model.built and [n.id for n in plan.graph][1:] == ["block0", "block1", "block2",
                                                            "head"]
    model.fit(np.ones((8, 16), "float32"), np.ones((8, 1), "float32"), verbose=0)


def test_the_planner_builds_layers_left_unbuilt_by_model_build():
    x = np.random.default_rng(0).standard_normal((32, 4)).astype("float32")
    y = np.random.default_rng(1).standard_normal((32, 2)).astype("float32")
    plain = built_by_shape()
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model = built_by_shape()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
              callbacks=[tfremat.Planner(1e9, verbose=0)])
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_model_built_by_shape_is_rewritten_with_a_segment():
    """Its build shape has no batch size (`model.build((None, 4))`), from which
    the rewrite made a batch to find the order of the calls, and failed
    (`np.zeros` of None): a Planner fit crashed once a plan recomputed."""
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    model = built_by_shape()
    model(x[:1])  # what the error about unbuilt layers advises
    graph = tfremat.extract(model, sample=(x, y))
    ids = [n.id for n in graph if not n.is_input]
    rewritten = tfremat.rewrite(model, tfremat.Plan.from_segments(graph, [ids[:2]]))
    np.testing.assert_allclose(rewritten(x).numpy(), model(x).numpy(), rtol=1e-6)
