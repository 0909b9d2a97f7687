"""Models, plans and comparisons shared by the rewriter's tests."""

from __future__ import annotations

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf

from tfremat.graph import fingerprint, walk
from tfremat.core import Plan, Segment
from tfremat.rewriter.compilers import units_compiled

REL_TOL = 1e-5


def plan_for(model: keras.Model, segments: list) -> Plan:
    segs = [s if isinstance(s, Segment) else Segment(list(s)) for s in segments]
    return Plan(fingerprint(walk(model)), segments=segs)


def body_ids(model: keras.Model) -> list[str]:
    """Call-site ids of the model, input layers left out, in execution order."""
    return [s.id for s in walk(model) if not s.is_input]


def _merge_shared(model: keras.Model, cuts: list[int]) -> list[int]:
    """Drops cuts that would split the calls of a shared layer."""
    sites = [s for s in walk(model) if not s.is_input]
    span: dict[str, list[int]] = {}
    for i, s in enumerate(sites):
        span.setdefault(s.layer_key, []).append(i)
    return [c for c in cuts
            if not any(min(v) < c <= max(v) for v in span.values() if len(v) > 1)]


def contiguous_segments(model: keras.Model, cuts: list[int]) -> list[list[str]]:
    """Segments between the cut positions (any contiguous range is convex)."""
    ids = body_ids(model)
    bounds = [0, *sorted(set(_merge_shared(model, [c for c in cuts if 0 < c < len(ids)]))),
              len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def articulation_cuts(model: keras.Model) -> list[int]:
    """Positions after which a single tensor is live (cheap segment borders)."""
    sites = walk(model)
    readers: dict[str, int] = {}
    for i, s in enumerate(sites):
        for ref in s.inputs:
            readers[ref] = max(readers.get(ref, -1), i)
    cuts, live = [], {}
    for i, s in enumerate(sites):
        for k in range(len(s.output_tensors)):
            live[f"{s.id}:{k}"] = readers.get(f"{s.id}:{k}", len(sites))
        live = {r: last for r, last in live.items() if last > i}
        if len(live) == 1 and not s.is_input:
            cuts.append(i)
    n_inputs = sum(s.is_input for s in sites)
    return [c - n_inputs + 1 for c in cuts]


def sqrt_segments(model: keras.Model) -> list[list[str]]:
    """About sqrt(n) segments of similar size, cut where one tensor is live;
    the last stretch (the head) stays outside."""
    ids = body_ids(model)
    cuts = articulation_cuts(model)
    k = max(1, round(math.sqrt(len(ids))))
    targets = [len(ids) * j / k for j in range(1, k)]
    chosen = sorted({min(cuts, key=lambda c: abs(c - t)) for t in targets} if cuts else set())
    segments = contiguous_segments(model, chosen)
    return segments[:-1] if len(segments) > 1 else segments


def snapshot(model: keras.Model) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.variables]


def restore(model: keras.Model, values: list[np.ndarray]) -> None:
    for v, x in zip(model.variables, values):
        v.assign(x)


def train_grads(model: keras.Model, x, mode: str = "eager"):
    """Outputs and gradients (by variable id) of a fixed loss after one
    forward pass in training mode."""

    def step(x):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.add_n([tf.reduce_sum(tf.square(tf.cast(o, "float32")) * 0.5)
                             + tf.reduce_sum(tf.cast(o, "float32"))
                             for o in tf.nest.flatten(out)])
        return tf.nest.flatten(out), tape.gradient(loss, model.trainable_variables)

    if mode in ("function", "units"):
        step = tf.function(step)
    elif mode == "xla":
        step = tf.function(step, jit_compile=True)
    with units_compiled() if mode == "units" else contextlib.nullcontext():
        outs, grads = step(x)
    return ([o.numpy() for o in outs],
            {id(v): tf.convert_to_tensor(g).numpy()
             for v, g in zip(model.trainable_variables, grads)})


def rel_error(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    x = np.concatenate([g.ravel() for g in a]).astype(np.float64)
    y = np.concatenate([g.ravel() for g in b]).astype(np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def assert_same_step(original: keras.Model, rewritten: keras.Model, x,
                     mode: str = "eager", original_mode: str | None = None) -> None:
    """One training-mode step of each model from the same state: gradients
    within REL_TOL, non-trainable state (BatchNorm statistics, SeedGenerator
    states) after the step bit-identical (within REL_TOL where the original
    runs in another `original_mode`, which compiles it otherwise), forward
    outputs identical in eager."""
    start = snapshot(original)
    outs_a, grads_a = train_grads(original, x, original_mode or mode)
    after_a = snapshot(original)
    restore(original, start)
    outs_b, grads_b = train_grads(rewritten, x, mode)
    after_b = snapshot(original)
    restore(original, start)
    assert grads_a.keys() == grads_b.keys()
    err = rel_error(list(grads_a.values()), [grads_b[k] for k in grads_a])
    assert err <= REL_TOL, f"gradients differ: relative error {err:.3g}"
    for v, p, q in zip(original.variables, after_a, after_b):
        if original_mode in (None, mode):
            np.testing.assert_array_equal(p, q, err_msg=f"state {v.path} differs")
        else:
            np.testing.assert_allclose(q, p, rtol=REL_TOL, atol=REL_TOL * np.abs(p).max(),
                                       err_msg=f"state {v.path} differs")
    if mode == "eager":
        for p, q in zip(outs_a, outs_b):
            np.testing.assert_array_equal(p, q)


# -- models -------------------------------------------------------------------


def deep_mlp(depth: int = 12, width: int = 32) -> keras.Model:
    x = keras.Input((16,))
    h = x
    for _ in range(depth):
        h = keras.layers.Dense(width, activation="tanh")(h)
    return keras.Model(x, keras.layers.Dense(4)(h), name="deep_mlp")


def residual_cnn(blocks: int = 3) -> keras.Model:
    x = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(x)
    for _ in range(blocks):
        r = keras.layers.Conv2D(8, 3, padding="same")(h)
        r = keras.layers.BatchNormalization()(r)
        r = keras.layers.ReLU()(r)
        r = keras.layers.Dropout(0.3)(r)
        r = keras.layers.Conv2D(8, 3, padding="same")(r)
        r = keras.layers.BatchNormalization()(r)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(x, keras.layers.Dense(5)(h), name="residual_cnn")


def unet() -> keras.Model:
    x = keras.Input((16, 16, 2))
    c1 = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    p1 = keras.layers.MaxPooling2D()(c1)
    c2 = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(p1)
    p2 = keras.layers.MaxPooling2D()(c2)
    b = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(p2)
    b = keras.layers.BatchNormalization()(b)
    u2 = keras.layers.UpSampling2D()(b)
    m2 = keras.layers.Concatenate()([u2, c2])
    d2 = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(m2)
    u1 = keras.layers.UpSampling2D()(d2)
    m1 = keras.layers.Concatenate()([u1, c1])
    d1 = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(m1)
    return keras.Model(x, keras.layers.Conv2D(1, 1)(d1), name="unet")


def rnn_stack() -> keras.Model:
    x = keras.Input((6, 5))
    h = keras.layers.LSTM(8, return_sequences=True)(x)
    h = keras.layers.GRU(8, return_sequences=True, dropout=0.2)(h)
    h = keras.layers.LSTM(8)(h)
    return keras.Model(x, keras.layers.Dense(3)(h), name="rnn_stack")


def transformer_block(seq: int = 8, dim: int = 16) -> keras.Model:
    x = keras.Input((seq, dim))
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=0.1)(x, x)
    a = keras.layers.Dropout(0.1)(a)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([x, a]))
    f = keras.layers.Dense(32, activation="gelu")(h)
    f = keras.layers.Dropout(0.1)(keras.layers.Dense(dim)(f))
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, f]))
    out = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(x, out, name="transformer_block")


def shared_layer_model() -> keras.Model:
    a = keras.Input((8,))
    b = keras.Input((8,))
    shared = keras.layers.Dense(8, activation="relu", name="shared")
    ha = shared(a)
    hb = shared(b)
    h = keras.layers.Concatenate()([ha, hb])
    h = keras.layers.Dense(8, activation="relu")(h)
    h = keras.ops.add(h, keras.ops.multiply(h, h))  # bare keras.ops nodes
    out1 = keras.layers.Dense(2, name="head_1")(h)
    out2 = keras.layers.Dense(3, name="head_2")(keras.layers.Dense(4)(h))
    return keras.Model([a, b], [out1, out2], name="shared_layer_model")


def nested_model() -> keras.Model:
    i = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu")(i)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.2)(h)
    inner = keras.Model(i, keras.layers.Dense(8)(h), name="inner")
    x = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu")(x)
    h = inner(h)
    h = keras.layers.Dense(8, activation="relu")(h)
    return keras.Model(x, keras.layers.Dense(2)(h), name="outer")


def batch_for(model: keras.Model, batch: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((batch, *t.shape[1:])).astype("float32")
          for t in model.inputs]
    return xs[0] if len(xs) == 1 else xs


# -- memory -------------------------------------------------------------------


def training_step(model: keras.Model, jit_compile: bool):
    """A compiled SGD training step `(x, y) -> loss` of `model`, with the
    model's own optimizer when it was compiled with one (a model rewritten
    for updates in the backward pass updates through it)."""
    optimizer = getattr(model, "optimizer", None) or keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return tf.function(step, jit_compile=jit_compile)


def step_peak_bytes(step, x, y, repeats: int = 3) -> int:
    """Peak CPU allocator bytes one step adds above what was live before it
    (the smallest of `repeats` measured steps)."""
    step(x, y).numpy()  # trace, compile, warm up
    peaks = []
    for _ in range(repeats):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        step(x, y).numpy()
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return min(peaks)


def compiled_peak_bytes(model: keras.Model, x, y, jit_compile: bool,
                        compilations: int) -> int:
    """The smallest step peak over `compilations` fresh compilations.

    Under XLA on CPU the peak of one model's step changes from one compilation
    to the next (ResNet50 at 96x96, batch 16: vanilla 351-472 MB, rewritten
    240-369 MB over five compilations in one process), while each compiled
    step repeats its own peak exactly.
    """
    return min(step_peak_bytes(training_step(model, jit_compile), x, y)
               for _ in range(compilations))
