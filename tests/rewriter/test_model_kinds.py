"""Model kinds and layer features beyond the plain functional graph."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tests.rewriter import rewrite_helpers as h
from tfremat.core import Segment
from tfremat.rewriter import PlanInstallation, RecomputeSegment, rewrite_model


def test_sequential_model_is_rewritten():
    keras.utils.set_random_seed(13)
    model = keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3),
    ])
    ids = h.body_ids(model)
    rewritten = rewrite_model(model, h.plan_for(model, [ids[:4]]))
    assert isinstance(rewritten.layers[1], RecomputeSegment)
    h.assert_same_step(model, rewritten, h.batch_for(model))


def _masked_model() -> keras.Model:
    tokens = keras.Input((7,), dtype="int32")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = keras.layers.LSTM(8, return_sequences=True)(x)
    x = keras.layers.LSTM(8)(x)
    return keras.Model(tokens, keras.layers.Dense(2)(x))


def test_masks_stay_inside_a_segment():
    keras.utils.set_random_seed(14)
    model = _masked_model()
    ids = h.body_ids(model)
    rewritten = rewrite_model(model, h.plan_for(model, [ids[:-1]]))
    tokens = np.array([[3, 4, 5, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7]], "int32")
    h.assert_same_step(model, rewritten, tokens)


def test_mask_crossing_a_segment_border_is_carried():
    # tests/rewriter/test_masks_and_losses.py covers masks and losses in depth.
    keras.utils.set_random_seed(18)
    model = _masked_model()
    ids = h.body_ids(model)
    rewritten = rewrite_model(model, h.plan_for(model, [ids[1:3]]))
    tokens = np.array([[3, 4, 5, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7]], "int32")
    h.assert_same_step(model, rewritten, tokens)


def test_activity_regularizer_in_a_segment_keeps_its_loss():
    keras.utils.set_random_seed(19)
    x = keras.Input((4,))
    y = keras.layers.Dense(4, activity_regularizer="l2")(x)
    model = keras.Model(x, keras.layers.Dense(1)(y))
    rewritten = rewrite_model(model, h.plan_for(model, [h.body_ids(model)[:1]]))
    batch = np.random.default_rng(0).standard_normal((2, 4)).astype("float32")
    grads = []
    for m in (model, rewritten):
        with tf.GradientTape() as tape:
            out = m(batch, training=True)
            loss = tf.add_n(m.losses + [tf.reduce_sum(out)])
        grads.append([g.numpy() for g in tape.gradient(loss, m.trainable_variables)])
        assert len(m.losses) == 1
    assert h.rel_error(grads[0], grads[1]) <= h.REL_TOL


def test_integer_inputs_to_a_segment_keep_weight_gradients():
    keras.utils.set_random_seed(15)
    tokens = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(30, 8)(tokens)
    x = keras.layers.Dense(8, activation="relu")(x)
    model = keras.Model(tokens, keras.layers.Dense(2)(keras.layers.Flatten()(x)))
    rewritten = rewrite_model(model, h.plan_for(model, [h.body_ids(model)[:2]]))
    batch = np.random.default_rng(0).integers(0, 30, (2, 5)).astype("int32")
    for mode in ("eager", "function"):
        h.assert_same_step(model, rewritten, batch, mode)


def test_explicit_training_argument_of_a_node_is_kept():
    keras.utils.set_random_seed(16)
    x = keras.Input((8,))
    y = keras.layers.Dense(8)(x)
    y = keras.layers.Dropout(0.5)(y, training=True)  # applies unless told otherwise
    model = keras.Model(x, keras.layers.Dense(2)(y))
    rewritten = rewrite_model(model, h.plan_for(model, [h.body_ids(model)[:2]]))
    batch = np.ones((4, 8), "float32")
    start = h.snapshot(model)
    expected = model(batch)
    h.restore(model, start)
    np.testing.assert_array_equal(rewritten(batch), expected)
    assert not np.allclose(expected, model(batch, training=False))
    h.assert_same_step(model, rewritten, batch)


def test_multi_input_multi_output_segment():
    keras.utils.set_random_seed(17)
    model = h.shared_layer_model()
    ids = h.body_ids(model)
    segment = ids[:ids.index("head_1") + 1]
    rewritten = rewrite_model(model, h.plan_for(model, [Segment(segment)]))
    layer = next(layer for layer in rewritten.layers if isinstance(layer, RecomputeSegment))
    assert len(layer.submodel.inputs) == 2 and len(layer.submodel.outputs) >= 2
    h.assert_same_step(model, rewritten, h.batch_for(model))


def test_a_plan_made_by_tracing_fits_a_model_whose_second_input_is_read_late():
    """Image and metadata inputs, the metadata read only at the head: the traced
    graph lists both inputs first, and the rewriter's graph of the model must
    too (its fingerprint follows the order), or every plan is refused."""
    keras.utils.set_random_seed(18)
    image = keras.Input((16, 16, 3), name="image")
    meta = keras.Input((4,), name="meta")
    x = image
    for filters in (8, 8, 8):
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    x = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(x),
                                    keras.layers.Dense(4, activation="relu")(meta)])
    model = keras.Model({"image": image, "meta": meta}, keras.layers.Dense(3)(x))
    model.compile("sgd", "mse")
    graph = tfremat.extract(model, batch_size=2)
    convs = [n.id for n in graph if n.class_name == "Conv2D"]
    rewritten = rewrite_model(model, tfremat.Plan.from_segments(graph, [convs[:2]]))
    assert any(isinstance(layer, RecomputeSegment) for layer in rewritten.layers)
    batch = {"image": np.random.default_rng(0).standard_normal((2, 16, 16, 3), "float32"),
             "meta": np.random.default_rng(1).standard_normal((2, 4), "float32")}
    h.assert_same_step(model, rewritten, batch)


def test_outputs_made_inside_a_segment_keep_their_names(tmp_path):
    """A loss dict, per-output metrics and History name a model's outputs
    after the layers that make them; the rewritten model's are made inside a
    segment, and must still answer to the original names."""
    keras.utils.set_random_seed(19)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c0")(inp)
    aux = keras.layers.Dense(4, activation="softmax", name="aux")(
        keras.layers.GlobalAveragePooling2D(name="p0")(x))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(x)
    main = keras.layers.Dense(4, activation="softmax", name="main")(
        keras.layers.GlobalAveragePooling2D(name="p1")(x))
    model = keras.Model(inp, [main, aux])
    settings = dict(optimizer="sgd", loss={"main": "sparse_categorical_crossentropy",
                                           "aux": "sparse_categorical_crossentropy"},
                    metrics={"main": ["accuracy"]})
    rewritten = rewrite_model(model, h.plan_for(model, [["c0", "p0", "aux", "c1"],
                                                        ["p1", "main"]]))
    assert rewritten.output_names == ["main", "aux"]
    x_batch = np.random.default_rng(0).standard_normal((4, 8, 8, 3), "float32")
    y = {"main": np.array([0, 1, 2, 3]), "aux": np.array([3, 2, 1, 0])}
    weights = h.snapshot(model)
    model.compile(**settings)
    want = model.train_on_batch(x_batch, y, return_dict=True)
    h.restore(model, weights)
    rewritten.compile(**settings)
    got = rewritten.train_on_batch(x_batch, y, return_dict=True)
    assert got == want  # the same keys, the same numbers (losses from the logits)
    rewritten.save(tmp_path / "r.keras")
    assert keras.models.load_model(tmp_path / "r.keras").output_names == ["main", "aux"]


class HalvedGradients(keras.Model):
    """A functional model with its own `train_step`, as Keras's guide to
    customizing `fit` makes them: it halves every gradient."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply([0.5 * g for g in grads], self.trainable_variables)
        return {"loss": loss}


class NeedsWidth(HalvedGradients):
    def __init__(self, width, **kwargs):
        inputs = keras.Input((8,))
        super().__init__(inputs, keras.layers.Dense(width)(inputs), **kwargs)


def test_a_functional_model_with_its_own_train_step_keeps_it():
    """`tfremat.rewrite` rebuilt a functional subclass as a plain `keras.Model`:
    its own `train_step` silently stopped running (here, training moved 0.03
    from the user's). The rewritten model is of the user's class now."""
    def build():
        keras.utils.set_random_seed(15)
        inputs = keras.Input((8,))
        h1 = keras.layers.Dense(16, activation="relu")(inputs)
        h2 = keras.layers.Dense(16, activation="relu")(h1)
        model = HalvedGradients(inputs, keras.layers.Dense(2)(h2))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8)).astype("float32")
    y = rng.standard_normal((32, 2)).astype("float32")
    plain = build()
    plain.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model = build()
    rewritten = rewrite_model(model, h.plan_for(model, [h.body_ids(model)[:2]]))
    assert type(rewritten) is HalvedGradients
    assert isinstance(rewritten.layers[1], RecomputeSegment)
    rewritten.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rewritten.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_class_that_cannot_be_rebuilt_is_refused_with_the_way_out():
    keras.utils.set_random_seed(16)
    model = NeedsWidth(4)
    with pytest.raises(tfremat.UnsupportedModelError,
                       match=r"NeedsWidth, whose own train_step .* tfremat.Planner"):
        rewrite_model(model, h.plan_for(model, []))


def test_a_sequential_subclass_with_its_own_train_step_is_refused_with_the_way_out():
    class HalvedSequential(keras.Sequential):
        train_step = HalvedGradients.train_step

    keras.utils.set_random_seed(18)
    model = HalvedSequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    with pytest.raises(tfremat.UnsupportedModelError,
                       match=r"HalvedSequential, whose own train_step .* tfremat.Planner"):
        rewrite_model(model, h.plan_for(model, []))


def test_the_planner_runs_a_plan_inside_a_class_that_cannot_be_rebuilt():
    """The Planner runs only the rewritten graph's call inside the user's model,
    so a class whose constructor takes other arguments trains with a plan,
    its own train_step included."""
    class Wide(HalvedGradients):
        def __init__(self, width, **kwargs):
            inputs = keras.Input((8,))
            h1 = keras.layers.Dense(width, activation="relu")(inputs)
            h2 = keras.layers.Dense(width, activation="relu")(h1)
            super().__init__(inputs, keras.layers.Dense(2)(h2), **kwargs)

    def fit(plan=None):
        keras.utils.set_random_seed(17)
        model = Wide(16)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((32, 8)).astype("float32")
        y = rng.standard_normal((32, 2)).astype("float32")
        if plan is None:
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        else:
            with PlanInstallation(model, h.plan_for(model, [h.body_ids(model)[:2]])):
                model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model.get_weights()

    for a, b in zip(fit(), fit(plan=True)):
        np.testing.assert_array_equal(a, b)
