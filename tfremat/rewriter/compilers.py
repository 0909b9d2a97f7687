"""What TensorFlow's graph compilers may do to the ops the rewriter adds.

Grappler, the executor's graph optimiser, removes ops it finds redundant (an
`Identity` round trip, an `IdentityN` whose extra input nothing reads): an op
marked with `keep` stays. XLA (`jit_compile=True`, Keras's default with a GPU)
compiles the whole step and ignores both `tf.device` and such marks.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import control_flow_util

#: The attribute Grappler's optimisers leave an op alone for.
KEEP_ATTR = "_grappler_do_not_remove"


def keep(tensor: tf.Tensor) -> tf.Tensor:
    """Marks the op making `tensor` so that Grappler does not remove it.

    Args:
        tensor: A graph tensor (an eager one is returned as it is).

    Returns:
        `tensor`.
    """
    if not tf.executing_eagerly():
        tensor.op._set_attr(KEEP_ATTR, attr_value_pb2.AttrValue(b=True))
    return tensor


def in_xla() -> bool:
    """Whether the graph being built is compiled by XLA (`jit_compile=True`)."""
    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
