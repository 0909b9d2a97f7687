"""Cost model of graph operations: bytes of tensors and FLOPs of ops."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

# Ops whose output shares its input's buffer (no new allocation).
ALIAS_OPS = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "Snapshot", "PreventGradient", "EnsureShape", "Bitcast",
})

# Ops whose outputs take no memory of their own in the step.
FREE_OPS = frozenset({
    "Const", "Placeholder", "ReadVariableOp", "VarHandleOp", "NoOp", "Shape", "ShapeN",
    "Size", "Rank", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceApplyGradientDescent", "ResourceApplyAdam",
})

# Ops Grappler fuses with a following BiasAdd (one output buffer).
FUSED_WITH_BIAS = frozenset({"Conv2D", "MatMul", "DepthwiseConv2dNative", "Conv3D"})

# Elementwise ops whose output may reuse their first input's buffer.
ELEMENTWISE_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "Sigmoid", "Tanh", "Softplus", "Softsign",
    "LeakyRelu", "Gelu", "Exp", "Log", "Neg", "Abs", "Square", "Sqrt", "Rsqrt",
    "AddV2", "Add", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "BiasAdd",
    "Cast", "Erf", "Floor", "Round", "SquaredDifference", "Pow", "Swish",
})

_CONV_OPS = ("Conv2D", "Conv3D", "_FusedConv2D", "Conv2DBackpropInput",
             "Conv2DBackpropFilter", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2")


def tensor_bytes(t: tf.Tensor) -> int:
    """Bytes of a tensor with a static shape (0 when the shape is unknown)."""
    shape = t.shape
    if shape.rank is None or not shape.is_fully_defined():
        return 0
    try:
        size = t.dtype.size
    except (TypeError, AttributeError):  # resource and variant tensors
        return 0
    return int(np.prod(shape.as_list(), dtype=np.int64)) * size


def _elements(t: tf.Tensor) -> int:
    shape = t.shape
    if shape.rank is None or not shape.is_fully_defined():
        return 0
    return int(np.prod(shape.as_list(), dtype=np.int64))


def _static(t: tf.Tensor) -> list[int] | None:
    shape = t.shape
    return shape.as_list() if shape.rank is not None and shape.is_fully_defined() else None


def op_flops(op: tf.Operation) -> float:
    """Floating point operations of one graph operation (an estimate)."""
    t = op.type
    if t in FREE_OPS or t in ALIAS_OPS or not op.outputs:
        return 0.0
    out = op.outputs[0]
    if t in ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "_MklMatMul"):
        a = _static(op.inputs[0])
        if a is None:
            return 0.0
        adj = op.get_attr("transpose_a") if t == "MatMul" else op.get_attr("adj_x")
        k = a[-2] if adj else a[-1]
        return 2.0 * _elements(out) * k
    if t in _CONV_OPS:
        if t == "Conv2DBackpropInput":
            dy, w = op.inputs[2], op.inputs[1]
            ws = _static(w)
            return 2.0 * _elements(dy) * (ws[0] * ws[1] * ws[2] if ws else 0)
        if t == "Conv2DBackpropFilter":
            dy = op.inputs[2]
            fs = _static(out)
            return 2.0 * _elements(dy) * (fs[0] * fs[1] * fs[2] if fs else 0)
        w = _static(op.inputs[1])
        if w is None:
            return 0.0
        return 2.0 * _elements(out) * float(np.prod(w[:-1]))
    if t.startswith("DepthwiseConv2dNative"):
        backprop = t.endswith(("BackpropInput", "BackpropFilter"))
        # The filter's shape: input 1, or the output of the filter gradient.
        w = _static(out if t.endswith("BackpropFilter") else op.inputs[1])
        if w is None or len(w) < 2:
            return 0.0
        return 2.0 * _elements(op.inputs[2] if backprop else out) * w[0] * w[1]
    if t == "Einsum":
        return _einsum_flops(op)
    return float(sum(_elements(o) for o in op.outputs))


def _einsum_flops(op: tf.Operation) -> float:
    equation = op.get_attr("equation").decode()
    lhs, _ = equation.split("->")
    dims: dict[str, int] = {}
    for spec, tensor in zip(lhs.split(","), op.inputs):
        shape = _static(tensor)
        if shape is None or "." in spec:
            return float(_elements(op.outputs[0]))
        for letter, size in zip(spec, shape):
            dims[letter] = size
    return 2.0 * float(np.prod(list(dims.values()), dtype=np.float64))
