"""Measured peaks: a real figure, and the model is not trained by measuring."""

import keras
import numpy as np

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


def test_larger_batch_measures_larger_peak():
    model = make_model()
    small = tfremat.measure_peak(model, batch_size=4)
    large = tfremat.measure_peak(model, batch_size=32)
    assert large > small


def test_sparse_labels_are_inferred_with_the_measured_trace_only(monkeypatch):
    model = make_model()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    # The targets are worked out on the step being measured, not by tfremat.trace.
    monkeypatch.setattr("tfremat.graph.tracing.trace", None)
    result = tfremat.measure_peak(model, batch_size=8, return_details=True)
    assert result.step_bytes >= 8 * 32 * 32 * 16 * 4


def test_synthetic_batches_count_in_the_allocator():
    import tensorflow as tf

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
