"""`recompute_grad`'s wait for the incoming gradient, with gradients that are not finite."""

import numpy as np
import tensorflow as tf

from tfremat.rewriter.recompute_grad import recompute_grad

TABLE = tf.Variable(np.arange(12, dtype="float32").reshape(6, 2))


def lookup(ids: tf.Tensor) -> tf.Tensor:
    return tf.gather(TABLE, ids) * 2.0


def gradients(fn, ids: tf.Tensor, upstream: float) -> tf.Tensor:
    with tf.GradientTape() as tape:
        out = fn(ids)
    return tape.gradient(out, TABLE, output_gradients=tf.fill(out.shape, upstream))


def test_a_nan_gradient_reaches_the_weights_as_without_recompute():
    ids = tf.constant([1, 4, 4], dtype=tf.int32)
    plain = tf.convert_to_tensor(gradients(lookup, ids, float("nan")))
    # Integer inputs must not receive the NaN through the recompute's wait:
    # cast to an integer it is an index of about -2**31, and the gather fails.
    recomputed = tf.convert_to_tensor(gradients(recompute_grad(lookup), ids, float("nan")))
    np.testing.assert_array_equal(np.isnan(recomputed), np.isnan(plain))


def test_finite_gradients_are_those_without_recompute():
    ids = tf.constant([0, 5, 2, 2], dtype=tf.int32)
    plain = tf.convert_to_tensor(gradients(lookup, ids, 1.5))
    recomputed = tf.convert_to_tensor(gradients(recompute_grad(lookup), ids, 1.5))
    np.testing.assert_array_equal(recomputed, plain)
