"""Kernel workspaces: scratch memory a kernel allocates that the graph does not show.

Some kernels allocate temporary buffers while they run, on top of their inputs
and outputs. With TensorFlow's own CPU kernels (oneDNN off), a 3x3
`Conv2DBackpropFilter` on a 9 MiB activation allocates 27.8 MiB of scratch, and
a backward pass of a CNN reaches it at every convolution; on a GPU, cuDNN's
workspaces go through the same allocator. The graph has no trace of them, so
each distinct heavy op of the step (type, input shapes and dtypes, attributes)
is run alone on the budgeted device, on zeros. Its scratch is what its
allocations asked for and gave back before it returned, at their peak, read
from the profiler's memory events (`_requested_bytes`): the simulator's
allocator then decides the chunks, as TensorFlow's does in the step. Where the
profiler cannot run (another session is on), it is read from the allocator
instead, chunks included: the peak while it runs minus what is in use once it
returned (its inputs and outputs), the median of three runs (`_scratch_bytes`).
In a fresh process such a read is often a whole region (a filter gradient that
asked for 24.4 MiB read 32.0), and it moves with what the process allocated
before.

Ops that cannot run alone are left out: stateful ops, ops on resources or
variants, ops calling functions (loops, conditionals) and ops whose integer
inputs (shapes, axes) are not constants of the graph. Calls of functions that
XLA must compile are run, as one kernel: Keras compiles each grouped
convolution (ConvNeXt's depthwise `Conv2D(groups=channels)`) with XLA, because
TensorFlow's own kernels do not run it on CPU, and XLA's CPU backend turns the
convolution's gradient into a dense one over all channels, whose scratch (220
MiB for ConvNeXtTiny's last stage at batch 16) is larger than anything the graph
shows.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import re
import time
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context, execute

from tfremat.backend import device_name, kernels_at_once, memory_stats_available
from tfremat.graph import profiler

#: Ops whose inputs and outputs together are smaller are not measured, except
#: convolutions and XLA-compiled calls (Keras's grouped convolutions):
#: TensorFlow's CPU convolution gradients size their im2col buffer by the L3
#: cache, not by the tensors (a 1x1 `Conv2DBackpropInput` over 1 MiB of tensors
#: allocates 20.9 MiB), and XLA's CPU backend makes a grouped convolution's
#: gradient dense over the channels.
MIN_OP_BYTES = 1 << 20

#: Seconds spent measuring at most; ops left when it runs out count no scratch.
TIME_LIMIT = 30.0

_UNMEASURABLE_DTYPES = (tf.resource, tf.variant, tf.string)

#: Integer inputs this small and not constant are taken for shapes or axes,
#: which zeros would not stand in for; larger ones (labels, indices) are zeros.
_SHAPE_LIKE_ELEMENTS = 8


@dataclasses.dataclass(frozen=True)
class KernelWorkspaces:
    """Measured scratch bytes of a step's kernels.

    Attributes:
        bytes_by_op: For each measured op with scratch (its index in the
            step's op list), the bytes of scratch its kernel allocates.
        device: The device measured on.
        measured: Distinct ops run (op type, shapes and attributes).
        skipped: Heavy ops that could not run alone or were left out when
            the time limit passed.
        seconds: Time the measurement took.
        requested: Whether `bytes_by_op` are the bytes the kernels asked for
            (read from the profiler's memory events), else the allocator's
            chunks handed out for them (`_scratch_bytes`).
    """

    bytes_by_op: dict[int, int]
    device: str
    measured: int
    skipped: int
    seconds: float
    requested: bool = False

    @property
    def concurrent(self) -> bool:
        """Whether two kernels' scratch can be live at once on `device`.

        On CPU, TensorFlow's executor runs ready operations side by side on its
        inter-op threads (the gradients of a convolution's input and filter
        both start when its output gradient is ready); a GPU runs a step's
        kernels one after the other on its compute stream.
        """
        return self.threads > 1

    @property
    def threads(self) -> int:
        """How many kernels can run (and hold scratch) at once on `device`:
        TensorFlow's inter-op threads on CPU, one on a GPU."""
        return kernels_at_once(self.device)

    def metadata(self) -> dict[str, Any]:
        """A summary for `PlanGraph.metadata["kernel_workspaces"]`."""
        return {"device": self.device, "measured_ops": self.measured,
                "skipped_ops": self.skipped, "seconds": round(self.seconds, 3),
                "largest_bytes": max(self.bytes_by_op.values(), default=0),
                "concurrent": self.concurrent, "requested": self.requested}


def measure_kernel_workspaces(ops: list[tf.Operation], *, device: str | None = None,
                              time_limit: float = TIME_LIMIT) -> KernelWorkspaces:
    """Runs each distinct heavy op of `ops` alone and measures its scratch.

    Resets the device's peak memory statistic (`reset_memory_stats`).

    Args:
        ops: The operations of a traced step, in order.
        device: The device to run on; default the one tfremat budgets.
        time_limit: Seconds to spend at most.

    Returns:
        `KernelWorkspaces`. Empty when the device keeps no allocator
        statistics (on CPU, oneDNN off without `TF_CPU_ALLOCATOR_USE_BFC=1`).
    """
    device = device or device_name()
    start = time.perf_counter()
    found: dict[tuple, int | None] = {}
    key_of: dict[int, tuple] = {}  # op index -> its call's key, for the ops that ran
    skipped = 0
    if not memory_stats_available(device):
        return KernelWorkspaces({}, device, 0, 0, 0.0)
    traced: list[tuple[tuple, int]] = []  # key and op index of each call traced
    with context.eager_mode(), tf.device(device), profiler.profiled() as events:
        for index, op in enumerate(ops):
            call = _runnable(op)
            if call is None:
                continue
            key = call.key()
            if key not in found:
                if time.perf_counter() - start > time_limit:
                    skipped += 1
                    continue
                run = call.runner()
                if events is None:
                    found[key] = _scratch_bytes(run, device)
                elif _ran_traced(run, len(traced)):
                    found[key] = 0  # what it asked for is read once the session ends
                    traced.append((key, index))
                else:
                    found[key] = None
            if found[key] is None:
                skipped += 1
            else:
                key_of[index] = key
    requested = events is not None and events.space is not None
    if requested:
        asked = _requested_bytes(events.space, len(traced), device)
        found.update((key, asked.get(k, 0)) for k, (key, _) in enumerate(traced))
    elif traced:  # the session's events could not be read: the allocator's reads
        with context.eager_mode(), tf.device(device):
            for key, index in traced:
                found[key] = _scratch_bytes(_runnable(ops[index]).runner(), device)
    bytes_by_op = {index: found[key] for index, key in key_of.items() if found[key]}
    measured = sum(1 for v in found.values() if v is not None)
    return KernelWorkspaces(bytes_by_op, device, measured, skipped,
                            time.perf_counter() - start, requested)


#: The name of the profiler's trace around each call run for its requests.
_TRACE_NAME = "tfremat_kernel"

_MEMORY_EVENTS = ("MemoryAllocation", "MemoryDeallocation")


def _requested_bytes(space: Any, calls: int, device: str = "CPU:0") -> dict[int, int]:
    """For each call run in a `_TRACE_NAME` trace (by its `call` number), the
    peak of the bytes asked for by its allocations on `device` that it freed
    before its trace ended: its kernel's scratch as requested, before the
    allocator's rounding and the chunks it hands out whole."""
    windows: list[tuple[int, int, int]] = []  # start, end (ps), call
    memory: list[tuple[int, bool, int, int]] = []  # time, is allocation, address, bytes
    for event in profiler.events(space, (_TRACE_NAME, *_MEMORY_EVENTS)):
        stats = event.stats
        if event.name == _TRACE_NAME:
            if "call" in stats:
                windows.append((event.start_ps, event.end_ps, stats["call"]))
        elif "addr" in stats and _on_device(stats.get("allocator_name") or "", device):
            memory.append((event.start_ps, event.name == "MemoryAllocation", stats["addr"],
                           stats.get("requested_bytes") or 0))
    memory.sort()
    times = [m[0] for m in memory]
    asked: dict[int, int] = {}
    for begin, end, call in windows:
        if not 0 <= call < calls:
            continue
        inside = memory[bisect.bisect_left(times, begin):bisect.bisect_right(times, end)]
        # The allocations freed inside the window (an address freed may be
        # handed out again, to an output that outlives it).
        made_at: dict[int, int] = {}  # address -> index in `inside` of its allocation
        freed: set[int] = set()
        for k, (_, allocation, address, _) in enumerate(inside):
            if allocation:
                made_at[address] = k
            elif address in made_at:
                freed.add(made_at.pop(address))
        live = peak = 0
        held: dict[int, int] = {}
        for k, (_, allocation, address, nbytes) in enumerate(inside):
            if allocation and k in freed:
                held[address] = nbytes
                live += nbytes
                peak = max(peak, live)
            elif not allocation and address in held:
                live -= held.pop(address)
        asked[call] = peak
    return asked


def _on_device(allocator: str, device: str) -> bool:
    """Whether an allocation by `allocator` (an event's `allocator_name`) is on
    `device`: a GPU's allocator is `GPU_<k>_bfc`; a GPU's host-side
    allocations (shapes, pinned buffers) are not that GPU's, and no GPU's
    are the CPU's."""
    gpu = re.search(r"GPU:(\d+)", device.upper())
    name = allocator.lower()
    if gpu:
        return name.startswith(f"gpu_{gpu.group(1)}_")
    return not name.startswith("gpu_")


def _ran_traced(run: Any, call: int) -> bool:
    """Whether `run()` ran: once for its first-use allocations (and XLA's
    compilation), then in a `_TRACE_NAME` trace numbered `call`, whose
    allocations `_requested_bytes` reads. Its outputs are freed after the
    trace: an output is no scratch."""
    try:
        run()
        with tf.profiler.experimental.Trace(_TRACE_NAME, call=call):
            outputs = run()
        del outputs
    except (tf.errors.OpError, TypeError, ValueError):
        return False
    return True


def _scratch_bytes(run: Any, device: str) -> int | None:
    """Peak bytes in use while `run()` runs, beyond what it leaves in use;
    None if it does not run. `run` is called once first: that call makes the
    first-use allocations (and compiles, for XLA).

    The allocator counts chunks, and what one run reads depends on the chunks
    free then: a free chunk under twice a request is handed out whole (46.0
    MiB read for a `Conv2DBackpropFilter` that asked for 30.4, whose chunk in
    the step was 32.0), and an output handed a larger chunk lowers the read
    (24.5 MiB for an XLA call that read 32.0 twice and held 33.7 in the
    step). The run is repeated twice more, each time holding one more block
    of three quarters of what the last run read, which takes the chunk it got
    (or another that would be handed out whole) away from it; the median of
    the three reads counts.
    """
    held: list[tf.Tensor] = []
    reads: list[int] = []
    try:
        run()
        for _ in range(3):
            if reads:
                if not reads[-1]:
                    return 0
                held.append(tf.zeros([reads[-1] * 3 // 4], tf.uint8))
            reads.append(_peak_above_current(run, device))
    except (tf.errors.OpError, TypeError, ValueError):
        return None
    finally:
        del held
    return sorted(reads)[1]


def _peak_above_current(run: Any, device: str) -> int:
    """Peak bytes in use while `run()` runs, beyond what is in use after it."""
    tf.config.experimental.reset_memory_stats(device)
    outputs = run()
    info = tf.config.experimental.get_memory_info(device)
    del outputs
    return max(0, int(info["peak"] - info["current"]))


def _zeros(specs: list[tuple[tf.DType, tuple[int, ...], Any]]) -> list[tf.Tensor]:
    """Inputs for a measured call: the graph's constants, zeros elsewhere."""
    return [tf.constant(c, dtype=d) if c is not None else tf.zeros(s, d) for d, s, c in specs]


@dataclasses.dataclass
class _Call:
    """One graph op, as an eager call: its type, inputs and attributes."""

    op_type: str
    inputs: list[tuple[tf.DType, tuple[int, ...], Any]]  # dtype, shape, constant value
    attrs: list[Any]
    num_outputs: int

    def key(self) -> tuple:
        consts = tuple(None if c is None else c.tobytes() for _, _, c in self.inputs)
        return (self.op_type, tuple((d.name, s) for d, s, _ in self.inputs), consts,
                repr(self.attrs))

    def runner(self) -> Any:
        """A function running the op once, on its inputs."""
        return functools.partial(execute.execute, self.op_type, self.num_outputs,
                                 _zeros(self.inputs), tuple(self.attrs), context.context(),
                                 name="tfremat_kernel")


@dataclasses.dataclass
class _XlaCall:
    """A call of a function that XLA must compile, as an eager call of that
    function on its flat inputs (captures included)."""

    function: Any  # the graph's AtomicFunction
    inputs: list[tuple[tf.DType, tuple[int, ...], Any]]

    def key(self) -> tuple:
        return ("xla", self.function.name, tuple((d.name, s) for d, s, _ in self.inputs))

    def runner(self) -> Any:
        """A function running the compiled function once, on its inputs."""
        return functools.partial(self.function.call_flat, *_zeros(self.inputs))


def _xla_call(op: tf.Operation) -> _XlaCall | None:
    """`op` (a stateless call with tensor inputs) as a call of its function,
    if XLA must compile that function."""
    function = op.graph._get_function(op.get_attr("f").name)
    if function is None or not function.cached_definition.attr["_XlaMustCompile"].b:
        return None
    return _XlaCall(function, [(t.dtype, tuple(t.shape.as_list()), None) for t in op.inputs])


def _runnable(op: tf.Operation) -> _Call | _XlaCall | None:
    """`op` as an eager call, if it is heavy and can run alone."""
    if not op.inputs or not op.outputs or op.op_def.is_stateful:
        return None
    tensors = list(op.inputs) + list(op.outputs)
    if any(t.dtype in _UNMEASURABLE_DTYPES for t in tensors):
        return None
    if any(not t.shape.is_fully_defined() for t in tensors):
        return None
    if op.type == "PartitionedCall":
        return _xla_call(op)
    size = sum(t.shape.num_elements() * t.dtype.size for t in tensors)
    if size < MIN_OP_BYTES and "Conv" not in op.type:
        return None
    inputs = []
    for t in op.inputs:
        value = None
        if t.dtype.is_integer or t.dtype == tf.bool:
            value = _static_value(t)
            if value is None and t.shape.num_elements() <= _SHAPE_LIKE_ELEMENTS:
                return None  # a shape or axes computed at run time
        inputs.append((t.dtype, tuple(t.shape.as_list()), value))
    attrs = []
    for name in sorted(op.node_def.attr):
        if name.startswith("_"):
            continue
        kind = op.node_def.attr[name].WhichOneof("value")
        if kind in ("func", "tensor", "shape", "placeholder"):
            return None
        if kind == "list" and (op.node_def.attr[name].list.func
                               or op.node_def.attr[name].list.shape
                               or op.node_def.attr[name].list.tensor):
            return None
        value = op.get_attr(name)
        if isinstance(value, tf.DType):
            value = value.as_datatype_enum
        elif isinstance(value, list) and value and isinstance(value[0], tf.DType):
            value = [v.as_datatype_enum for v in value]
        attrs += [name, value]
    return _Call(op.type, inputs, attrs, len(op.outputs))


def _static_value(t: tf.Tensor) -> Any:
    """`t`'s value if the graph fixes it, else None: constants, and the
    shapes that `Shape` and `ShapeN` (made by the convolutions' gradients) read
    off fully defined tensors."""
    if t.op.type == "ShapeN":
        shape = t.op.inputs[t.value_index].shape
        if shape.is_fully_defined():
            return np.array(shape.as_list(), dtype=t.dtype.as_numpy_dtype)
        return None
    return tf.get_static_value(t)
