"""The everyday Keras setups of tests/setups: a model, its data and how it is fit.

Each setup builds the same model (same seed) every time it is called, so a
plain fit and a fit with the `Planner` start from the same weights.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

SEED = 11


@dataclasses.dataclass
class Setup:
    """A model, its training data and the arguments of its `fit`.

    Attributes:
        model: The compiled model.
        x: Inputs (or a `tf.data.Dataset` of `(x, y)` batches, then `y` is None).
        y: Targets.
        fit_kwargs: More arguments of `fit` (batch size, sample weights, ...).
        deterministic_ops: Fit with `tf.config.experimental.enable_op_determinism()`,
            for a setup whose plain fits differ from each other by more than
            the comparison allows.
    """

    model: keras.Model
    x: Any
    y: Any = None
    fit_kwargs: dict = dataclasses.field(default_factory=dict)
    deterministic_ops: bool = False


IMAGE = 48


def _images(n: int = 128, size: int = IMAGE, classes: int = 10):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, size, size, 3)).astype("float32")
    labels = rng.integers(0, classes, n)
    return x, labels


def _conv_trunk(inp: Any, width: int = 32, blocks: int = 6, regularized: bool = False) -> Any:
    """Residual conv blocks; `regularized` puts a kernel regularizer on the
    first conv of every other block and an activity regularizer on the second."""
    x = inp
    for i in range(blocks):
        reg = regularized and i % 2 == 1
        y = keras.layers.Conv2D(
            width, 3, padding="same", name=f"conv{i}a",
            kernel_regularizer=keras.regularizers.L2(1e-4) if reg else None)(x)
        y = keras.layers.BatchNormalization(name=f"bn{i}")(y)
        y = keras.layers.ReLU(name=f"relu{i}")(y)
        y = keras.layers.Conv2D(
            width, 3, padding="same", name=f"conv{i}b",
            activity_regularizer=keras.regularizers.L2(1e-6) if reg else None)(y)
        x = keras.layers.Add(name=f"add{i}")([x, y]) if x.shape[-1] == width else y
        x = keras.layers.ReLU(name=f"out{i}")(x)
    return keras.layers.GlobalAveragePooling2D(name="pool")(x)


def _cnn(name: str = "cnn") -> keras.Model:
    inp = keras.Input((IMAGE, IMAGE, 3), name="image")
    out = keras.layers.Dense(10, activation="softmax", name="head")(_conv_trunk(inp))
    return keras.Model(inp, out, name=name)


def metrics() -> Setup:
    model = _cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x, y = _images()
    return Setup(model, x, y, {"batch_size": 32})


def loss_dict() -> Setup:
    inp = keras.Input((IMAGE, IMAGE, 3), name="image")
    trunk = _conv_trunk(inp)
    cls = keras.layers.Dense(10, activation="softmax", name="cls")(trunk)
    reg = keras.layers.Dense(2, name="box")(trunk)
    model = keras.Model(inp, {"cls": cls, "box": reg}, name="two_heads")
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss={"cls": "sparse_categorical_crossentropy", "box": "mse"},
                  loss_weights={"cls": 1.0, "box": 0.5})
    x, labels = _images()
    boxes = np.random.default_rng(1).standard_normal((len(x), 2)).astype("float32")
    return Setup(model, x, {"cls": labels, "box": boxes}, {"batch_size": 32})


def sample_and_class_weights() -> Setup:
    model = _cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x, y = _images()
    weights = np.linspace(0.5, 1.5, len(x)).astype("float32")
    return Setup(model, x, y, {"batch_size": 32, "sample_weight": weights})


def class_weights() -> Setup:
    model = _cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x, y = _images()
    return Setup(model, x, y, {"batch_size": 32,
                               "class_weight": {k: 1.0 + 0.1 * k for k in range(10)}})


def _tokens(n: int = 64, length: int = 96, vocab: int = 500):
    rng = np.random.default_rng(0)
    x = rng.integers(1, vocab, (n, length))
    lengths = rng.integers(length // 2, length + 1, n)
    x[np.arange(length)[None, :] >= lengths[:, None]] = 0  # padding, masked
    return x.astype("int32"), rng.integers(0, 2, n).astype("int32")


#: Long enough that the floor leaves room under 70% of the plain peak: at 96
#: tokens the backward loops' in-flight partial gradients (sized like the
#: kernels) held the lowest plan at 19.3-20.4 MiB against a 20.6 MiB budget, and
#: epochs went over it by a step's spread; at 192 it measures 35.9 against 40.1.
RNN_LENGTH = 192


def rnn_with_mask() -> Setup:
    inp = keras.Input((RNN_LENGTH,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(500, 64, mask_zero=True, name="embed")(inp)
    x = keras.layers.Bidirectional(keras.layers.LSTM(64, return_sequences=True),
                                   name="bilstm")(x)
    x = keras.layers.GRU(64, return_sequences=True, name="gru")(x)
    x = keras.layers.GRU(64, name="gru_last")(x)
    out = keras.layers.Dense(2, activation="softmax", name="head")(x)
    model = keras.Model(inp, out, name="rnn")
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
    x, y = _tokens(length=RNN_LENGTH)
    return Setup(model, x, y, {"batch_size": 32})


def transformer_with_mask() -> Setup:
    length, dim = 64, 64
    inp = keras.Input((length,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(500, dim, name="embed")(inp)
    for b in range(2):
        h = keras.layers.LayerNormalization(name=f"ln{b}a")(x)
        h = keras.layers.MultiHeadAttention(4, dim // 4, name=f"attn{b}")(
            h, h, use_causal_mask=True)
        x = keras.layers.Add(name=f"res{b}a")([x, h])
        h = keras.layers.LayerNormalization(name=f"ln{b}b")(x)
        h = keras.layers.Dense(4 * dim, activation="gelu", name=f"mlp{b}a")(h)
        h = keras.layers.Dense(dim, name=f"mlp{b}b")(h)
        x = keras.layers.Add(name=f"res{b}b")([x, h])
    out = keras.layers.Dense(500, name="logits")(x)
    model = keras.Model(inp, out, name="gpt")
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    # Batch 32: at 16 the plan chosen (11.2-11.8 MiB in its trial) reached 14.0
    # in an epoch under load against a 13.5 budget; at 32, under the same load,
    # epochs measured 22.2-24.2 MiB against 28.5 (bf16: 22.4-23.8 against 26.4).
    tokens = rng.integers(1, 500, (128, length + 1)).astype("int32")
    return Setup(model, tokens[:, :-1], tokens[:, 1:], {"batch_size": 32})


def text_vectorization() -> Setup:
    """An end-to-end text classifier: strings in, `TextVectorization` inside
    the model (its ragged ops lose the batch's static size), residual Conv1Ds."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 400, (128, 256))
    texts = np.array([" ".join(f"w{w}" for w in row[:rng.integers(128, 257)])
                      for row in words], dtype=object)
    vectorize = keras.layers.TextVectorization(max_tokens=402, output_sequence_length=256,
                                               name="vectorize")
    vectorize.adapt(texts)
    inp = keras.Input((), dtype="string", name="text")
    x = keras.layers.Embedding(402, 64, name="embed")(vectorize(inp))
    for i in range(6):
        y = keras.layers.Conv1D(64, 5, padding="same", activation="relu", name=f"conv{i}a")(x)
        y = keras.layers.Conv1D(64, 5, padding="same", name=f"conv{i}b")(y)
        x = keras.layers.ReLU(name=f"out{i}")(keras.layers.Add(name=f"add{i}")([x, y]))
    x = keras.layers.GlobalMaxPooling1D(name="pool")(x)
    model = keras.Model(inp, keras.layers.Dense(2, activation="softmax", name="head")(x),
                        name="text")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    # The embedding's sparse update sums repeated token ids in an order that
    # varies from run to run: its values moved by ~3e-9 (relative) per step, and
    # where that flips a ReLU at zero, a conv bias moved by up to 2e-4 within
    # four steps, plan or no plan (fits with plans differed from plain by 7e-6 to 3e-5 in
    # all). With deterministic kernels every plan tried trained bit-identically.
    return Setup(model, texts, rng.integers(0, 2, 128).astype("int32"), {"batch_size": 32},
                 deterministic_ops=True)


def activity_regularizer() -> Setup:
    # Deep enough that activations, not one conv's backward scratch, make the
    # peak: a 4-conv model's least peak is its plain one (see limitations.md).
    # The activity regularizers sit on convs that feed an Add: on a conv that
    # feeds BatchNorm, plain fits in fresh processes differed from each other
    # by 1.5-3.6e-6, more than the 1e-6 this test allows the rewrite (same
    # graph in every process; with Grappler off they agreed). Their weight is
    # 1e-6: at 1e-4 the regularization loss was 6x the data loss, and a 1e-7
    # change of the starting weights grew 600-fold over the two epochs.
    inp = keras.Input((IMAGE, IMAGE, 3), name="image")
    out = keras.layers.Dense(10, activation="softmax", name="head")(
        _conv_trunk(inp, regularized=True))
    model = keras.Model(inp, out, name="regularized")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x, y = _images()
    return Setup(model, x, y, {"batch_size": 32})


class ClippedStep(keras.Model):
    """A functional model with its own train_step (gradient clipping by value)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=pred)
        grads = tape.gradient(loss, self.trainable_variables)
        grads = [tf.clip_by_value(g, -1.0, 1.0) for g in grads]
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def custom_train_step() -> Setup:
    inp = keras.Input((IMAGE, IMAGE, 3), name="image")
    out = keras.layers.Dense(10, activation="softmax", name="head")(_conv_trunk(inp))
    model = ClippedStep(inp, out, name="custom_step")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x, y = _images()
    return Setup(model, x, y, {"batch_size": 32})


class Block(keras.layers.Layer):
    """conv-BN-ReLU-conv, added to the input when the widths match, then ReLU."""

    def __init__(self, width: int = 32, **kwargs):
        super().__init__(**kwargs)
        self.conv_a = keras.layers.Conv2D(width, 3, padding="same")
        self.bn = keras.layers.BatchNormalization()
        self.conv_b = keras.layers.Conv2D(width, 3, padding="same")

    def call(self, x, training=None):
        y = self.conv_b(keras.ops.relu(self.bn(self.conv_a(x), training=training)))
        return keras.ops.relu(x + y if x.shape[-1] == y.shape[-1] else y)


class Blocks(keras.Model):
    """A subclassed model of conv blocks, each a subclassed layer (the
    residual blocks of the functional setups)."""

    # Four Sequential conv-BN-ReLU blocks were too shallow for 70%: plans
    # measured 125-145 MiB against a plain 137-152 in one process, so the
    # minimum a refused budget stated was not met again. A conv stem before
    # these blocks made even the plain fit differ between processes (7e-7
    # relative after two epochs): hence none.

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [Block() for _ in range(6)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(10, activation="softmax")

    def call(self, x, training=None):
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.pool(x))


def subclassed() -> Setup:
    model = Blocks(name="blocks")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x, y = _images()
    model(x[:1])
    return Setup(model, x, y, {"batch_size": 32})


def loaded_from_keras_file() -> Setup:
    setup = metrics()
    path = os.path.join(os.environ.get("TFREMAT_SETUP_TMP", "."), "setup_model.keras")
    setup.model.save(path)
    setup.model = keras.models.load_model(path)
    return setup


def mixed_bfloat16() -> Setup:
    # A Transformer, as bf16 is mostly used: TensorFlow's bf16 convolutions on a
    # CPU without oneDNN take ~5 s per step (the CNN setup took 144 s here).
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    return transformer_with_mask()


def tf_data_smaller_last_batch() -> Setup:
    setup = metrics()
    x, y = _images(n=120)  # batches of 32, 32, 32 and 24
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    return Setup(setup.model, dataset, None, {})


def jit_compile() -> Setup:
    model = _cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
                  jit_compile=True)
    x, y = _images()
    return Setup(model, x, y, {"batch_size": 32})


def steps_per_execution() -> Setup:
    model = _cnn()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy",
                  steps_per_execution=4)
    x, y = _images(n=256)
    return Setup(model, x, y, {"batch_size": 32})


def adam() -> Setup:
    model = _cnn()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    x, y = _images()
    return Setup(model, x, y, {"batch_size": 32})


SETUPS: dict[str, Callable[[], Setup]] = {
    f.__name__: f for f in (
        metrics, loss_dict, sample_and_class_weights, class_weights, rnn_with_mask,
        transformer_with_mask, activity_regularizer, custom_train_step, subclassed,
        loaded_from_keras_file, mixed_bfloat16, tf_data_smaller_last_batch, jit_compile,
        steps_per_execution, adam, text_vectorization)
}


#: Setups trained with Adam (a looser weight tolerance: see test_setups.py).
ADAM = {"adam"}


def build(name: str) -> Setup:
    """The setup `name`, its model built from the same seed every time."""
    keras.utils.set_random_seed(SEED)
    return SETUPS[name]()
