"""Cost model of graph operations: bytes of tensors and FLOPs of ops.

A loop (`While`, as Keras's recurrent layers run on TensorFlow) is costed from
its body: its FLOPs are the body's times the iterations, and each TensorList it
returns holds one element per iteration. The accumulators TensorFlow adds to a
loop for its gradient are such lists: they keep every step's state for the
backward loop.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

# Ops whose output shares its input's buffer (no new allocation).
ALIAS_OPS = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "Snapshot", "PreventGradient", "EnsureShape", "Bitcast",
    # A list made from a tensor holds slices of that tensor's buffer.
    "TensorListFromTensor",
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
    # Activation gradients and selects forward a dying input too
    # (`BinaryElementWiseOp`, `SelectV2Op` in TensorFlow's kernels; the profiler
    # shows a Dropout's and a ReLU's backward allocating nothing).
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "SigmoidGrad",
    "TanhGrad", "SoftplusGrad", "SoftsignGrad", "Select", "SelectV2",
})

# Other kernels writing an output into an input's buffer when nothing else
# reads that input: op type -> {output index: input index}. The softmax
# cross-entropies write the logits' gradient into the logits
# (`forward_input_or_allocate_output` in TensorFlow's xent kernels).
FORWARDING_OPS = {
    "SoftmaxCrossEntropyWithLogits": {1: 0},
    "SparseSoftmaxCrossEntropyWithLogits": {1: 0},
}

WHILE_OPS = frozenset({"While", "StatelessWhile"})

# Sums of a loop body into a loop variable (a gradient loop's weight gradients).
_SUMS = frozenset({"AddN", "AddV2", "Add"})

# TensorList reads in a loop body: the element is a saved tensor, not a new one.
_LIST_READS = frozenset({"TensorListPopBack", "TensorListGetItem"})

# TensorList writes in a loop body, and the input that is the element written.
_LIST_WRITES = {"TensorListPushBack": 1, "TensorListSetItem": 2}

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


def variable_bytes(variables: list) -> int:
    """Bytes of `variables` (weights, optimizer slots: static shapes)."""
    return int(sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables))


def output_bytes(op: tf.Operation, j: int) -> int:
    """Bytes of output `j` of `op`; for a loop's TensorList output, the bytes of
    the elements it gathers over all iterations."""
    out = op.outputs[j]
    if op.type in WHILE_OPS and out.dtype == tf.variant:
        return _list_bytes(op, j)
    return tensor_bytes(out)


def output_buffers(op: tf.Operation, j: int) -> int:
    """How many buffers output `j` of `op` is held in: one for each element a
    loop's TensorList output gathers (each iteration's tensor is a buffer of
    its own), one otherwise."""
    if op.type in WHILE_OPS and op.outputs[j].dtype == tf.variant and _list_bytes(op, j):
        return loop_iterations(op)
    return 1


def loop_iterations(op: tf.Operation) -> int:
    """Iterations of a `While` op: its static `maximum_iterations`, else the
    length of the TensorLists it reads (a scan over a sequence; the gradient
    loop reads the forward loop's accumulators); 1 when none is known."""
    limit = tf.get_static_value(op.inputs[1])
    if limit is not None and limit >= 0:
        return int(limit)
    counts = []
    for t in op.inputs:
        src = t.op
        if src.type == "TensorListFromTensor" and src.inputs[0].shape.rank:
            counts.append(src.inputs[0].shape[0])
        elif src.type == "TensorListReserve":
            counts.append(tf.get_static_value(src.inputs[1]))
        elif src.type in WHILE_OPS:
            counts.append(loop_iterations(src))
    return max((int(c) for c in counts if c is not None and c >= 0), default=1)


def _body(op: tf.Operation) -> tf.Graph | None:
    """The body graph of a `While` op, when its graph knows the function."""
    function = op.graph._get_function(op.get_attr("body").name)
    return getattr(function, "graph", None)


def _list_bytes(op: tf.Operation, j: int) -> int:
    """Bytes held by TensorList output `j` of a `While` op: the element the body
    writes each iteration, unless the element is the same buffer every time (a
    variable's value, a constant, a loop input passed through unchanged)."""
    body = _body(op)
    if body is None:
        return 0
    write = _unaliased(body.outputs[j]).op
    if write.type not in _LIST_WRITES:
        return 0
    element = write.inputs[_LIST_WRITES[write.type]]
    if element.op.type == "Placeholder":  # a loop variable: new each iteration?
        if any(t_in is element and t_out is element
               for t_in, t_out in zip(body.inputs, body.outputs)):
            return 0
    elif element.op.type in FREE_OPS:
        return 0
    return loop_iterations(op) * tensor_bytes(element)


def loop_run_ahead_bytes(op: tf.Operation) -> int:
    """Bytes that a `While` op's iterations in flight hold, beyond one iteration.

    TensorFlow runs up to `parallel_iterations` iterations of a loop at once
    (Keras's recurrent layers: 32). A gradient loop sums each iteration's
    weight-gradient partial into a loop variable; the chain of output gradients
    runs ahead of those sums, so partials wait, with the in-body tensors they
    read. Measured on CPU (`LSTM(64)`, batch 16, inputs of width 16, 64 and 128,
    32 and 64 steps, the largest of 30 steps): the loop's peak rose by 40, 89 and
    145 KiB per iteration in flight, one partial and the gate gradients it reads
    (`Concat`, 16 KiB); with `parallel_iterations=1` it did not rise. Counted
    here: the largest partial and the in-body tensors it reads, for each
    iteration in flight after the first (`min(parallel_iterations,
    iterations) - 1`). With width 16 that is 80 KiB, above the 40 measured.

    Args:
        op: A `While` op.

    Returns:
        The bytes, 0 for a loop summing nothing or running one iteration at a time.
    """
    body = _body(op)
    if body is None or "parallel_iterations" not in op.node_def.attr:
        return 0
    window = min(op.get_attr("parallel_iterations"), loop_iterations(op)) - 1
    if window <= 0:
        return 0
    per_iteration = 0
    for t_in, t_out in zip(body.inputs, body.outputs):
        total = _unaliased(t_out).op
        if total.type not in _SUMS or not t_out.dtype.is_floating:
            continue
        terms = [t for t in total.inputs if _unaliased(t) is not t_in]
        if len(terms) == len(total.inputs):
            continue  # not a sum into this loop variable
        for part in terms:
            read = {t.name: tensor_bytes(t) for t in part.op.inputs
                    if t.op.type not in FREE_OPS and t.op.type not in _LIST_READS
                    and t.op.type not in ALIAS_OPS}
            per_iteration = max(per_iteration, tensor_bytes(part) + sum(read.values()))
    return window * per_iteration


def _unaliased(t: tf.Tensor) -> tf.Tensor:
    """`t`, or the tensor whose buffer it shares through identities and reshapes."""
    while t.op.type in ALIAS_OPS and t.op.inputs:
        t = t.op.inputs[0]
    return t


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
    if t in WHILE_OPS:
        body = _body(op)
        return 0.0 if body is None else \
            loop_iterations(op) * sum(op_flops(b) for b in body.get_operations())
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
