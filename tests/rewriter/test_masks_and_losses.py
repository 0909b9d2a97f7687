"""Keras masks and activation losses cross recompute segments and offload units.

A segment whose input carries a Keras mask gives it to its layers; an output
whose mask is made inside comes out with it. Losses the segment's layers add
(`activity_regularizer`, `add_loss`) stay in `model.losses` once, and their
gradient flows through the recompute.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.rewriter import rewrite_helpers as h
from tfremat.core import Offload, Plan, Segment, UnsupportedModelError
from tfremat.graph import extract
from tfremat.rewriter import RecomputeSegment, rewrite_model
from tfremat.rewriter.exact_recompute import AddedLosses
from tfremat.rewriter.offload_layers import OffloadUnit
from tfremat.rewriter.subclassed import RecomputedCall

DEVICES = {"compute_device": "/CPU:0", "host_device": "/CPU:1"}
FIT_TOL = 1e-6


@keras.saving.register_keras_serializable(package="tfremat_tests")
class ActivationLoss(keras.layers.Layer):
    """Identity adding `rate * mean(x ** 2)` to the model's losses."""

    def __init__(self, rate: float = 1e-2, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate
        self.supports_masking = True

    def call(self, x):
        self.add_loss(self.rate * keras.ops.mean(keras.ops.square(x)))
        return x

    def get_config(self):
        return {**super().get_config(), "rate": self.rate}


class LossOnceArmed(keras.layers.Layer):
    """Once armed, adds a loss in its next call only: its recompute adds none."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.armed = False

    def call(self, x):
        if self.armed:
            self.armed = False
            self.add_loss(keras.ops.mean(x))
        return x


# -- models -------------------------------------------------------------------


def masked_rnn() -> keras.Model:
    """Embedding(mask_zero) -> LSTM -> Dense -> GRU -> masked average -> Dense.

    The pooling reads its input's mask from the tensor (no explicit `mask`
    argument in its node), so a segment border before it must carry the mask.
    """
    tokens = keras.Input((7,), dtype="int32")
    x = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    x = keras.layers.LSTM(8, return_sequences=True)(x)
    x = keras.layers.Dense(8, activation="tanh")(x)
    x = keras.layers.GRU(8, return_sequences=True)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(2)(x), name="masked_rnn")


def masked_transformer(attention_mask: bool = False) -> keras.Model:
    """Embedding(mask_zero) -> causal MultiHeadAttention (and optionally an
    explicit `attention_mask` input) -> Add, LayerNorm -> feed-forward -> Add,
    LayerNorm -> MultiHeadAttention -> Add, LayerNorm -> masked average -> Dense.

    MultiHeadAttention reads the padding masks of its query and value from the
    tensors (its node has no mask argument), so a segment border before it
    must carry them.
    """
    tokens = keras.Input((8,), dtype="int32")
    inputs = [tokens]
    x = keras.layers.Embedding(30, 16, mask_zero=True)(tokens)
    kwargs = {}
    if attention_mask:
        allowed = keras.Input((8, 8), dtype="bool")
        inputs.append(allowed)
        kwargs["attention_mask"] = allowed
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.1)(
        x, x, use_causal_mask=True, **kwargs)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([x, a]))
    f = keras.layers.Dense(32, activation="gelu")(h)
    f = keras.layers.Dropout(0.1)(keras.layers.Dense(16)(f))
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, f]))
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
    out = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs if attention_mask else tokens, out, name="masked_transformer")


def regularized_mlp() -> keras.Model:
    """Dense layers with an activity regularizer and an `add_loss` layer."""
    x = keras.Input((16,))
    h = keras.layers.Dense(32, activation="tanh")(x)
    h = keras.layers.Dense(32, activation="tanh",
                           activity_regularizer=keras.regularizers.L2(1e-3))(h)
    h = ActivationLoss()(h)
    h = keras.layers.Dropout(0.2)(keras.layers.Dense(32, activation="tanh")(h))
    return keras.Model(x, keras.layers.Dense(4)(h), name="regularized_mlp")


def tokens_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Token ids, each row padded with zeros after a random length >= 1."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (batch, seq)).astype("int32")
    for row, length in zip(tokens, rng.integers(1, seq + 1, batch)):
        row[length:] = 0
    return tokens


def batch_of(model: keras.Model, batch: int = 4, seed: int = 0):
    if model.name == "masked_rnn":
        return tokens_batch(batch, 7, 20, seed)
    if model.name == "masked_transformer":
        tokens = tokens_batch(batch, 8, 30, seed)
        if len(model.inputs) == 1:
            return tokens
        allowed = np.random.default_rng(seed + 1).random((batch, 8, 8)) < 0.8
        allowed[:, :, 0] = True  # every query sees one key at least
        return [tokens, allowed]
    return h.batch_for(model, batch, seed)


# Segments by model: [name, segments]; each crosses a mask border or holds a
# layer adding a loss.
PLANS = {
    "masked_rnn": [
        ("mask into a segment", [["global_average_pooling1d", "dense_1"]]),
        ("mask out of a segment", [["lstm", "dense", "gru"]]),
        ("mask made inside", [["embedding", "lstm"]]),
        ("nested", [Segment(["lstm", "dense", "gru", "global_average_pooling1d"],
                            children=[Segment(["global_average_pooling1d"])])]),
    ],
    "masked_transformer": [
        ("mask into and out of segments",
         [["multi_head_attention", "add", "layer_normalization"],
          ["dense", "dense_1", "dropout_1", "add_1", "layer_normalization_1"]]),
        ("mask out of a segment", [["embedding"]]),
        ("mask made and read inside", [["embedding", "multi_head_attention", "add"]]),
        ("second attention", [["multi_head_attention_1", "add_2"]]),
    ],
    "regularized_mlp": [
        ("regularized layer", [["dense", "dense_1"]]),
        ("both losses", [["dense_1", "activation_loss", "dense_2", "dropout"]]),
        ("nested", [Segment(["dense", "dense_1", "activation_loss", "dense_2"],
                            children=[Segment(["dense_1", "activation_loss"])])]),
    ],
}
BUILDERS = {
    "masked_rnn": masked_rnn,
    "masked_transformer": masked_transformer,
    "masked_transformer_attention_mask": lambda: masked_transformer(attention_mask=True),
    "regularized_mlp": regularized_mlp,
}
CASES = [(name, label, segments) for name in BUILDERS
         for label, segments in PLANS[name.replace("_attention_mask", "")]]


def build(name: str) -> keras.Model:
    model = BUILDERS[name]()
    model(batch_of(model))  # creates the losses' layers' state
    return model


# -- comparisons ----------------------------------------------------------------


def losses_step(model: keras.Model, x, mode: str):
    """One training-mode step: the added losses, the total loss and the
    gradients of the total loss and of the added losses alone."""

    def step(x):
        with tf.GradientTape(persistent=True) as tape:
            out = model(x, training=True)
            added = list(model.losses)
            extra = tf.add_n(added) if added else None
            total = tf.add_n([tf.reduce_sum(tf.square(o)) * 0.5 + tf.reduce_sum(o)
                              for o in tf.nest.flatten(out)] + added)
        variables = model.trainable_variables
        grads = tape.gradient(total, variables)
        extra_grads = [] if extra is None else tape.gradient(extra, variables)
        return added, total, grads, extra_grads

    if mode == "function":
        step = tf.function(step)
    added, total, grads, extra_grads = step(x)
    shapes = [v.shape for v in model.trainable_variables]

    def dense(gs):
        return [np.zeros(shape) if g is None else tf.convert_to_tensor(g).numpy()
                for g, shape in zip(gs, shapes)]

    return ([float(a) for a in added], float(total), dense(grads), dense(extra_grads))


def assert_same_losses_step(original: keras.Model, rewritten: keras.Model, x,
                            mode: str) -> None:
    """The added losses, the total loss and the gradients (of the total and of
    the added losses alone) agree, and `model.losses` keeps them after the
    backward pass."""
    start = h.snapshot(original)
    added_a, total_a, grads_a, extra_a = losses_step(original, x, mode)
    h.restore(original, start)
    added_b, total_b, grads_b, extra_b = losses_step(rewritten, x, mode)
    h.restore(original, start)
    assert len(added_b) == len(added_a)
    # The same losses; their order follows each model's own layer order.
    np.testing.assert_allclose(sorted(added_b), sorted(added_a), rtol=1e-5)
    np.testing.assert_allclose(total_b, total_a, rtol=1e-6)
    err = h.rel_error(grads_a, grads_b)
    assert err <= h.REL_TOL, f"gradients differ: relative error {err:.3g}"
    if extra_a:
        err = h.rel_error(extra_a, extra_b)
        assert err <= h.REL_TOL, f"gradients of model.losses differ: {err:.3g}"
    if mode == "eager":
        assert len(rewritten.losses) == len(added_a)


# -- tests --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name, label, segments", CASES)
def test_gradients_and_losses_match(name, label, segments, mode):
    keras.utils.set_random_seed(21)
    model = build(name)
    rewritten = rewrite_model(model, h.plan_for(model, segments))
    assert any(isinstance(layer, RecomputeSegment) for layer in rewritten.layers)
    x = batch_of(model)
    h.assert_same_step(model, rewritten, x, mode)
    assert_same_losses_step(model, rewritten, x, mode)


@pytest.mark.parametrize("name", ["masked_rnn", "masked_transformer_attention_mask",
                                  "regularized_mlp"])
def test_fit_gives_the_same_weights(name):
    keras.utils.set_random_seed(23)
    model = build(name)
    segments = PLANS[name.replace("_attention_mask", "")][-1][1]
    rewritten = rewrite_model(model, h.plan_for(model, segments))
    x = batch_of(model, batch=16, seed=3)
    y = np.random.default_rng(4).standard_normal((16, *model.outputs[0].shape[1:]))
    start = h.snapshot(model)
    histories, weights = [], []
    for m in (model, rewritten):
        h.restore(model, start)
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        histories.append(m.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                               verbose=0).history["loss"])
        weights.append(h.snapshot(model))
    np.testing.assert_allclose(histories[1], histories[0], rtol=FIT_TOL)
    floating = [i for i, v in enumerate(model.variables) if v.dtype.startswith("float")]
    err = h.rel_error([weights[0][i] for i in floating], [weights[1][i] for i in floating])
    assert err <= FIT_TOL, f"weights differ after fit: relative error {err:.3g}"


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_masked_offload_units(mode):
    keras.utils.set_random_seed(24)
    model = build("masked_transformer")
    plan = h.plan_for(model, [["dense", "dense_1", "dropout_1"]])
    # The embedding's output carries the padding mask into two offload units;
    # the second attention, a prefetch trigger, reads the masks of its inputs
    # through its gradient signal.
    plan.offloaded = [Offload("embedding:0", prefetch_after="multi_head_attention_1"),
                      Offload("layer_normalization_1:0")]
    rewritten = rewrite_model(model, plan, **DEVICES)
    assert any(isinstance(layer, OffloadUnit) for layer in rewritten.layers)
    h.assert_same_step(model, rewritten, batch_of(model), mode)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_regularized_offload_units(mode):
    keras.utils.set_random_seed(24)
    model = build("regularized_mlp")
    plan = h.plan_for(model, [])
    plan.offloaded = [Offload("dense:0", prefetch_after="dense_3"),
                      Offload("dense_1:0")]
    rewritten = rewrite_model(model, plan, **DEVICES)
    assert_same_losses_step(model, rewritten, batch_of(model), mode)


class MaskedSubclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(30, 8, mask_zero=True)
        self.proj = keras.layers.Dense(8, activation="tanh",
                                       activity_regularizer=keras.regularizers.L2(1e-3))
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.head = keras.layers.Dense(2)

    def call(self, x, training=None):
        return self.head(self.pool(self.proj(self.embed(x))))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_subclassed_sublayers_keep_masks_and_losses(mode):
    keras.utils.set_random_seed(25)
    model = MaskedSubclassed()
    x = tokens_batch(4, 8, 30)
    model(x)
    plan = Plan.from_segments(extract(model, sample=x),
                              [Segment([model.proj.name]), Segment([model.pool.name])])
    rewritten = rewrite_model(model, plan, sample=x)
    assert isinstance(rewritten.pool, RecomputedCall)
    h.assert_same_step(model, rewritten, x, mode)
    assert_same_losses_step(model, rewritten, x, mode)


def test_masked_segments_save_and_load(tmp_path):
    keras.utils.set_random_seed(26)
    model = build("masked_transformer_attention_mask")
    rewritten = rewrite_model(model, h.plan_for(model, PLANS["masked_transformer"][0][1]))
    x = batch_of(model)
    path = tmp_path / "masked.keras"
    rewritten.save(path)
    loaded = keras.models.load_model(path)
    assert sum(isinstance(layer, RecomputeSegment) for layer in loaded.layers) == 2
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(rewritten(x)))
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))


def test_a_recompute_adding_other_losses_names_the_layer():
    x = keras.Input((4,))
    fickle = LossOnceArmed(name="fickle")
    model = keras.Model(x, keras.layers.Dense(1)(fickle(keras.layers.Dense(4)(x))))
    rewritten = rewrite_model(model, h.plan_for(model, [h.body_ids(model)[:2]]))
    fickle.armed = True
    with tf.GradientTape() as tape:
        out = rewritten(np.ones((2, 4), "float32"), training=True)
        loss = tf.reduce_sum(out) + tf.add_n(rewritten.losses)
    with pytest.raises(UnsupportedModelError, match=r"\['fickle'\].*1 loss\(es\).*but 0"):
        tape.gradient(loss, rewritten.trainable_variables)


# -- logits cached on a softmax or sigmoid output ------------------------------


def saturated_classifier(activation: str) -> keras.Model:
    """A classifier whose head saturates: some probabilities are below
    `keras.config.epsilon()`, where a loss computed from clipped probabilities
    has no gradient and one computed from the logits has."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, activation=activation, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    head = model.get_layer("head")
    head.kernel.assign(head.kernel * 200.0)
    return model


def crossentropy_grads(model: keras.Model, x, y, activation: str, mode: str):
    """Loss and gradients of Keras's crossentropy on the model's output."""
    loss_fn = (keras.losses.categorical_crossentropy if activation == "softmax"
               else keras.losses.binary_crossentropy)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(loss_fn(y, model(x, training=True)))
        return loss, tape.gradient(loss, model.trainable_variables)

    if mode == "function":
        step = tf.function(step)
    loss, grads = step(x, y)
    return float(loss), [np.array(g) for g in grads]


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("unit", ["segment", "offload"])
@pytest.mark.parametrize("activation", ["softmax", "sigmoid"])
def test_a_units_softmax_or_sigmoid_output_keeps_its_logits_for_the_loss(
        activation, unit, mode):
    """Keras's crossentropies compute the loss of a softmax or sigmoid output
    from the logits cached on it (`_keras_logits`). A unit's output carries
    the unit's logits, so the loss and its gradient are those of the original:
    without them the loss is computed from clipped probabilities, with no
    gradient where the model is confidently wrong (and other rounding
    elsewhere, which made updates in the backward pass drift from plain
    training)."""
    keras.utils.set_random_seed(25)
    model = saturated_classifier(activation)
    x = np.random.default_rng(5).standard_normal((8, 4)).astype("float32")
    probabilities = np.array(model(x))
    # The target is the least likely class: the model is confidently wrong.
    y = (probabilities == probabilities.min(axis=1, keepdims=True)).astype("float32")
    assert (probabilities < keras.config.epsilon()).any(), "the head saturates"
    if unit == "segment":
        rewritten = rewrite_model(model, h.plan_for(model, [["head"]]))
        assert any(isinstance(layer, RecomputeSegment) for layer in rewritten.layers)
    else:
        plan = h.plan_for(model, [])
        plan.offloaded = [Offload("hidden:0")]
        rewritten = rewrite_model(model, plan, **DEVICES)
        assert any(isinstance(layer, OffloadUnit) for layer in rewritten.layers)
    loss_a, grads_a = crossentropy_grads(model, x, y, activation, mode)
    loss_b, grads_b = crossentropy_grads(rewritten, x, y, activation, mode)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
    assert h.rel_error(grads_a, grads_b) <= h.REL_TOL


def test_a_new_loss_is_not_taken_for_a_layer_that_kept_the_id_of_a_freed_one():
    """In a StatelessScope (a recompute) Keras gives a layer the losses whose id is
    in its `_loss_ids`, kept until a call enters the model: after a nested
    segment's recompute, a new loss reusing a freed one's id was counted as the
    old layer's (a flaky CI failure of the nested regularized_mlp case)."""
    kept, adding = keras.layers.Dense(2), keras.layers.Dense(2)
    loss = tf.constant(1.0)
    kept._loss_ids.add(id(loss))  # the id of a loss `kept` added, since freed
    with keras.StatelessScope(collect_losses=True):
        with AddedLosses([kept, adding]) as added:
            adding.add_loss(loss)
    assert [(layer.name, value) for layer, value in added.losses] == [(adding.name, loss)]
