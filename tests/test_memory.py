"""Measured peaks: a real figure, and the model is not trained by measuring."""

import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat


def make_model() -> keras.Model:
    inp = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(16, 3, padding="same")(inp)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, keras.layers.Dense(4)(x))
    model.compile(optimizer="adam", loss="mse")
    return model


def test_measured_peak_covers_weights_and_activations():
    model = make_model()
    result = tfremat.measure_peak(model, batch_size=8, return_details=True)
    assert result.device == "CPU:0"
    conv_output = 8 * 32 * 32 * 16 * 4
    assert result.step_bytes >= conv_output
    assert result.peak_bytes >= result.start_bytes + conv_output


def test_measuring_does_not_change_weights_or_optimizer_state():
    model = make_model()
    before = [v.numpy().copy() for v in model.variables]
    tfremat.measure_peak(model, batch_size=8)
    after = [v.numpy() for v in model.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert int(model.optimizer.iterations.numpy()) == 0


def test_measuring_with_an_unbuilt_adam_leaves_no_memory_behind():
    # The stand-in optimizer's slots were kept alive by TensorFlow's gradient
    # registry: each call left twice the weights on the device.
    inp = keras.Input((16, 16, 8))
    x = keras.layers.Flatten()(keras.layers.Conv2D(8, 3, padding="same")(inp))
    model = keras.Model(inp, keras.layers.Dense(512)(x))  # 4 MiB of weights
    model.compile(optimizer="adam", loss="mse")
    weights = sum(v.numpy().nbytes for v in model.trainable_variables)
    in_use = []
    for _ in range(5):
        tfremat.measure_peak(model, batch_size=4)
        in_use.append(tf.config.experimental.get_memory_info("CPU:0")["current"])
    # Leaking, four more calls leave 8x the weights; in a full test run what
    # other tests left may be freed or allocated meanwhile (seen: +1x once).
    assert in_use[4] - in_use[0] < 2 * weights, (in_use, weights)
    assert not model.optimizer.built


def test_restored_weights_stay_in_the_allocator():
    """`measure_peak` restores every variable from host copies. Assigned a
    NumPy array, a variable on CPU can keep the array's memory (when it is
    aligned as TensorFlow's own), outside the allocator's statistics, so the
    peaks measured afterwards (the Planner's epochs included) left those
    weights out: 3.5 of DenseNet121's 26.9 MiB after one measurement."""
    import gc

    from tfremat.memory import _Values

    gc.collect()
    gc.disable()  # nothing else freed meanwhile
    try:
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        weight = tf.Variable(tf.zeros([1024, 1024]))  # 4 MiB
        values = _Values([weight])
        values.pairs = [(weight, np.ones([1024, 1024], np.float32))]  # aligned as can be
        values.restore()
        held = tf.config.experimental.get_memory_info("CPU:0")["current"] - start
    finally:
        gc.enable()
    assert weight.numpy().all()
    assert held >= 4 * 2**20, held  # the weight's chunk, whatever its size


def test_larger_batch_measures_larger_peak():
    model = make_model()
    small = tfremat.measure_peak(model, batch_size=4)
    large = tfremat.measure_peak(model, batch_size=256)  # activations above any kernel scratch
    assert large > small


def test_sparse_labels_are_inferred_with_the_measured_trace_only(monkeypatch):
    model = make_model()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    # The targets are worked out on the step being measured, not by tfremat.trace.
    monkeypatch.setattr("tfremat.graph.tracing.trace", None)
    result = tfremat.measure_peak(model, batch_size=8, return_details=True)
    assert result.step_bytes >= 8 * 32 * 32 * 16 * 4


def test_synthetic_batches_count_in_the_allocator():
    from tfremat.memory import synthetic_batch

    tfremat.measure_peak(make_model(), batch_size=2)  # the allocator has stats now
    # A tensor made from a NumPy array may share the array's memory (it does when
    # the array is aligned, as large ones are) and then would not count.
    for mib in (1, 8, 32):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        batch = synthetic_batch(tf.TensorSpec((mib, 1024, 256), tf.float32))
        after = tf.config.experimental.get_memory_info("CPU:0")["current"]
        assert after - before >= batch.shape.num_elements() * 4
        del batch


class Counter(keras.layers.Layer):
    """Counts its training calls in a plain `tf.Variable` that Keras does not track."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = tf.Variable(0, dtype="int64", trainable=False)

    def call(self, x, training=None):
        if training:
            self.calls.assign_add(1)
        return x


def stateful_model() -> keras.Model:
    """Weights, BatchNorm statistics, a dropout seed, an untracked counter; Adam;
    a compiled metric. Nothing of its training state is built yet."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(32, 3, padding="same")(inp)
    x = keras.layers.BatchNormalization()(x)
    x = Counter(name="counter")(x)
    x = keras.layers.Dropout(0.3)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, keras.layers.Dense(4)(x))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def data(n: int = 32):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 16, 16, 3)).astype("float32"),
            rng.normal(size=(n, 4)).astype("float32"))


def all_variables(model: keras.Model) -> list:
    """Every variable of the model's training: Keras's, the optimizer's, the
    metrics' and the counter Keras does not see."""
    counter = model.get_layer("counter").calls
    assert all(v is not counter for v in model.variables)  # really untracked
    return [*model.variables, *model.optimizer.variables,
            *(v for m in model.metrics for v in m.variables), counter]


def values(variables: list) -> list[bytes]:
    return [np.asarray(v.numpy()).tobytes() for v in variables]


def training_state(model: keras.Model) -> tuple:
    """What a first fit builds, and the objects it builds on."""
    return (model.optimizer, model.optimizer.built, model._compile_loss.built,
            model._compile_metrics.built, [id(m) for m in model.metrics],
            len(model.optimizer.variables))


def test_every_variable_is_bit_identical_after_measuring_a_trained_model():
    model = stateful_model()
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # slots, statistics, counter move
    variables = all_variables(model)
    before = values(variables)
    assert int(model.get_layer("counter").calls.numpy()) > 0
    for _ in range(2):
        tfremat.measure_peak(model, batch_size=8)
        assert values(all_variables(model)) == before


def test_measuring_leaves_nothing_built_on_a_fresh_model():
    model = stateful_model()
    state, before = training_state(model), values(all_variables(model))
    assert not any(state[1:4])
    result = tfremat.measure_peak(model, batch_size=8, return_details=True)
    assert training_state(model) == state
    assert values(all_variables(model)) == before
    assert result.step_bytes >= 8 * 16 * 16 * 32 * 4  # a real step was measured


@pytest.mark.parametrize("trained", [False, True])
def test_two_measurements_then_fit_train_exactly_like_an_unmeasured_model(trained):
    x, y = data()
    histories, weights = [], []
    for measure in (True, False):
        model = stateful_model()
        if trained:
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        if measure:
            tfremat.measure_peak(model, batch_size=8)
            tfremat.measure_peak(model, batch_size=16)
        history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
        histories.append(history.history)
        weights.append(values(all_variables(model)))
    assert histories[0] == histories[1]
    assert weights[0] == weights[1]


def multi_output_model(loss: str, metric: str) -> keras.Model:
    inp = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(16, 3, padding="same")(inp)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inp, [keras.layers.Dense(3, name="a")(x),
                              keras.layers.Dense(5, name="b")(x)])
    model.compile(optimizer="adam", loss={"a": loss, "b": loss},
                  loss_weights={"a": 1.0, "b": 0.5}, metrics={"a": [metric], "b": [metric]})
    return model


@pytest.mark.parametrize("loss, metric", [("mse", "mae"),
                                          ("sparse_categorical_crossentropy", "accuracy")])
def test_multi_output_model_compiled_with_a_loss_dict(loss, metric):
    # Sparse labels are found on the second target spec tried: the first one's
    # failed trace must leave nothing behind for it.
    model = multi_output_model(loss, metric)
    state = training_state(model)
    result = tfremat.measure_peak(model, batch_size=8, return_details=True)
    assert result.step_bytes >= 8 * 32 * 32 * 16 * 4
    assert training_state(model) == state
    x = np.zeros((8, 32, 32, 3), "float32")
    labels = ({"a": np.zeros((8,)), "b": np.zeros((8,))} if loss != "mse" else
              {"a": np.zeros((8, 3)), "b": np.zeros((8, 5))})
    model.fit(x, labels, verbose=0)


def test_planning_a_fresh_multi_output_model_leaves_its_loss_unbuilt_for_measuring():
    """Tracing a step (`tfremat.extract`, which `tfremat.plan` runs first) used
    to build the user's compiled loss in a graph that never runs: a dict of
    losses' trackers stayed uninitialised, and the measurement that followed
    (`plan(..., measure=True)`, `measure_peak`) failed restoring them."""
    model = multi_output_model("mse", "mae")
    tfremat.extract(model, batch_size=8)
    assert not model._compile_loss.built and not model._compile_metrics.built
    assert tfremat.measure_peak(model, batch_size=8) > 0
    plan = tfremat.plan(model, budget_mb=1e4, batch_size=8, measure=True)
    assert plan.estimates.details["measured_peak_bytes"] > 0
    x = np.zeros((8, 32, 32, 3), "float32")
    history = model.fit(x, {"a": np.ones((8, 3)), "b": np.ones((8, 5))}, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_fresh_model_with_metrics_measures_without_warnings(caplog):
    model = make_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with caplog.at_level(logging.WARNING):
            tfremat.measure_peak(model, batch_size=8)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_unbuilt_model_is_refused_and_stays_unbuilt():
    model = keras.Sequential([keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse")
    sample = (np.ones((4, 8), "float32"), np.ones((4, 4), "float32"))
    with pytest.raises(tfremat.UnsupportedModelError, match="not built"):
        tfremat.measure_peak(model, sample=sample)
    assert not model.built and not model.optimizer.built


class BrokenStep(keras.Model):
    def train_step(self, data):
        x, y = data
        raise TypeError(f"broken step for targets of rank {len(y.shape)}")


def compiled_dense(model_class: type) -> keras.Model:
    """A one-Dense functional model of `model_class`, compiled with SGD and MSE."""
    inputs = keras.Input((8,))
    model = model_class(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_a_step_no_target_traces_with_names_the_error_of_each_kind_of_target():
    model = compiled_dense(BrokenStep)
    with pytest.raises(tfremat.UnsupportedModelError) as caught:
        tfremat.measure_peak(model, batch_size=4)
    # Each kind's own error: the step's for float targets, the loss's for labels.
    each = (r"(?s)with output-shaped float targets:.*broken step for targets of rank 2"
            r".*\n- with sparse integer targets: .*mse.*\nPass sample=\(x, y\)")
    assert caught.match(each)
    with pytest.raises(tfremat.UnsupportedModelError, match=each):
        tfremat.extract(model, batch_size=4)


class AlwaysBrokenStep(keras.Model):
    def train_step(self, data):
        raise ValueError("'update_dense@0' is not a valid scope name")


def test_an_error_whatever_the_targets_is_given_once_without_the_targets_hint():
    model = compiled_dense(AlwaysBrokenStep)
    with pytest.raises(tfremat.UnsupportedModelError) as caught:
        tfremat.measure_peak(model, batch_size=4)
    message = str(caught.value)
    assert "is not a valid scope name" in message
    # Not the sparse labels' loss error, nor a hint about targets.
    assert "sample=" not in message and "targets" not in message, message
    assert "Dimensions must be equal" not in message, message


class FailsOnSecondCall(keras.layers.Layer):
    """Raises at run time in the second training step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = tf.Variable(0, dtype="int64", trainable=False)

    def call(self, x, training=None):
        if training:
            self.calls.assign_add(1)
            tf.debugging.assert_less(self.calls, tf.constant(2, "int64"))
        return x


def test_a_step_that_raises_restores_everything():
    model = stateful_model()
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    inp = keras.Input((16, 16, 3))
    failing = keras.Model(inp, FailsOnSecondCall()(model(inp)))
    failing.compile(optimizer=model.optimizer, loss="mse")
    before = values(all_variables(model))
    with pytest.raises(tf.errors.InvalidArgumentError):
        tfremat.measure_peak(failing, batch_size=8)
    assert int(failing.layers[-1].calls.numpy()) == 0
    assert values(all_variables(model)) == before


def test_an_interrupted_measurement_restores_everything(monkeypatch):
    model = stateful_model()
    state, before = training_state(model), values(all_variables(model))

    def interrupt(device):  # after the warm-up step has run
        raise KeyboardInterrupt

    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", interrupt)
    with pytest.raises(KeyboardInterrupt):
        tfremat.measure_peak(model, batch_size=8)
    assert training_state(model) == state
    assert values(all_variables(model)) == before


def test_a_second_ctrl_c_during_the_restore_waits_until_everything_is_back(
        monkeypatch, ctrl_c_raises):
    import signal

    model = stateful_model()
    state, before = training_state(model), values(all_variables(model))
    interrupted = []

    def interrupt(device):  # after the warm-up step has run
        interrupted.append(True)
        raise KeyboardInterrupt

    owner = next(c for c in type(tf.Variable(0.0)).__mro__ if "assign" in vars(c))
    original, restored = owner.assign, []

    def assign(self, value, *args, **kwargs):
        if interrupted:  # the restore
            restored.append(self)
            if len(restored) == 2:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C again, halfway through
        return original(self, value, *args, **kwargs)

    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", interrupt)
    monkeypatch.setattr(owner, "assign", assign)
    with pytest.raises(KeyboardInterrupt):
        tfremat.measure_peak(model, batch_size=8)
    assert len(restored) > 2
    assert training_state(model) == state
    assert values(all_variables(model)) == before


def test_a_step_creating_variables_is_refused():
    class LazyState(keras.layers.Layer):
        state = None

        def call(self, x, training=None):
            if training and self.state is None:
                self.state = tf.Variable(0.0, trainable=False)
            return x

    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(2)(LazyState()(inp)))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tfremat.UnsupportedModelError, match="creates a variable"):
        tfremat.measure_peak(model, batch_size=4)
    assert model.layers[1].state is None


def test_variables_used_through_raw_handles_are_refused_before_running():
    hidden = tf.Variable(1.0)

    class RawBump(keras.layers.Layer):
        def call(self, x):
            tf.raw_ops.AssignAddVariableOp(resource=hidden.handle, value=1.0)
            return x

    inp = keras.Input((8,))
    model = keras.Model(inp, keras.layers.Dense(2)(RawBump()(inp)))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tfremat.UnsupportedModelError, match="raw handles"):
        tfremat.measure_peak(model, batch_size=4)
    assert float(hidden.numpy()) == 1.0


def test_rewritten_model_measures_lower_and_is_restored():
    from tests.rewriter import rewrite_helpers as h
    from tfremat.rewriter import rewrite_model

    keras.utils.set_random_seed(11)
    model = h.deep_mlp(depth=24, width=1024)
    model.compile(optimizer="adam", loss="mse")  # as the rewritten one: the same update
    rewritten = rewrite_model(model, h.plan_for(model, h.sqrt_segments(model)))
    rewritten.compile(optimizer="adam", loss="mse")
    before = values([*rewritten.variables, *rewritten.optimizer.variables])
    plain = tfremat.measure_peak(model, batch_size=256, return_details=True)
    smaller = tfremat.measure_peak(rewritten, batch_size=256, return_details=True)
    assert smaller.step_bytes < 0.8 * plain.step_bytes, (plain, smaller)
    assert values([*rewritten.variables, *rewritten.optimizer.variables]) == before
    assert not rewritten.optimizer.built


class ScaledSGD(keras.optimizers.SGD):
    """An optimizer whose config does not say how to make it again."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor


def test_an_unbuilt_optimizer_that_cannot_be_copied_is_refused_untouched():
    model = make_model()
    model.compile(optimizer=ScaledSGD(0.5), loss="mse")
    with pytest.raises(tfremat.UnsupportedModelError, match="Build it first"):
        tfremat.measure_peak(model, batch_size=8)
    assert not model.optimizer.built
    # What the message advises works, and the built state is restored exactly.
    model.optimizer.build(model.trainable_variables)
    before = values([*model.variables, *model.optimizer.variables])
    tfremat.measure_peak(model, batch_size=8)
    assert values([*model.variables, *model.optimizer.variables]) == before


_STATS_AFTER_IMPORT = """
import os
os.environ.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
import tensorflow as tf
import tfremat
assert os.environ["TF_CPU_ALLOCATOR_USE_BFC"] == "1"
tf.constant([1.0]) * 2.0
print(tf.config.experimental.get_memory_info("CPU:0")["peak"])
"""

_STATS_TOO_LATE = """
import os
os.environ.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
import tensorflow as tf
tf.constant([1.0]) * 2.0  # TensorFlow's devices exist before tfremat is imported
import keras
import tfremat
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("sgd", "mse")
try:
    tfremat.measure_peak(model, batch_size=2)
except RuntimeError as e:
    print("ERROR:", e)
"""


def test_importing_tfremat_gives_allocator_statistics_on_a_cpu_without_onednn():
    import os
    import subprocess
    import sys

    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
    ok = subprocess.run([sys.executable, "-c", _STATS_AFTER_IMPORT], env=env, text=True,
                        capture_output=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert int(ok.stdout.strip().splitlines()[-1]) > 0
    late = subprocess.run([sys.executable, "-c", _STATS_TOO_LATE], env=env, text=True,
                          capture_output=True, timeout=300)
    assert late.returncode == 0, late.stderr[-2000:]
    message = late.stdout.strip().splitlines()[-1]
    assert "no allocator statistics for CPU:0" in message
    assert "TF_CPU_ALLOCATOR_USE_BFC=1" in message
