"""The planning graph: one node per Keras layer call, with memory and cost facts.

This module imports neither TensorFlow nor Keras, so planners, the simulator and
their tests can build and read graphs without a deep learning framework.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, Iterable, Iterator, Sequence

from tfremat.core import jsonio

FORMAT_VERSION = 1

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2,
    "uint32": 4, "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16,
    # A TensorFlow string element is a 24-byte `tstring`; text longer than
    # fits in it lives outside the allocator, and strings stay in host memory.
    "string": 24,
}


def dtype_size(dtype: str) -> int:
    """Bytes of one element of `dtype` (a NumPy/TensorFlow dtype name)."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"Unknown dtype {dtype!r}.") from None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One output tensor of a node.

    Attributes:
        shape: Static shape, batch dimension included.
        dtype: dtype name, e.g. `"float32"`.
        bytes: Size in bytes.

    Example:

    >>> tfremat.TensorInfo.of((16, 56, 56, 64), "float32").bytes
    12845056
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int

    @classmethod
    def of(cls, shape: Iterable[int], dtype: str) -> "TensorInfo":
        shape = tuple(int(d) for d in shape)
        size = 1
        for d in shape:
            size *= d
        return cls(shape, dtype, size * dtype_size(dtype))

    @property
    def differentiable(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))


@dataclasses.dataclass
class Node:
    """One call of a Keras layer (or bare `keras.ops` operation).

    Attributes:
        id: Stable id: the layer name, `name@k` for the k-th call (k from 0) of a
            layer called more than once, `outer/inner` inside a flattened nested
            model.
        layer: Name of the called layer.
        class_name: Class of the layer, e.g. `"Conv2D"`.
        inputs: Tensor references `"node_id:index"` this call consumes, in order.
        outputs: The call's output tensors.
        backward_reads: Tensor references (own outputs or inputs) that the
            backward pass of this call reads, so they stay alive until it runs.
        backward_reads_released: Those of `backward_reads` that only the first
            ops of the backward pass read, which everything it allocates waits
            for (a fused activation's gradient reading the call's output):
            where the call is their last reader, they are freed before its
            workspace and input gradients exist. Empty in graphs saved before
            it was recorded.
        internal_saved_bytes: Bytes of tensors made inside the call, other than its
            outputs, that its backward pass keeps (e.g. BatchNorm's normalised value).
        internal_saved_pieces: How many buffers hold `internal_saved_bytes`, taken
            as equal: 1 for a call's intermediates, which the simulator's allocator
            holds in one chunk, an approximation; a loop's saved per-iteration
            tensors add one buffer for each iteration (an LSTM over 64 steps
            keeps 9 TensorLists of 64 small tensors each).
        forward_workspace_bytes: Peak transient memory of the call's forward ops
            beyond its outputs and saved tensors.
        backward_workspace_bytes: Peak transient memory of its backward ops beyond
            the input gradients it produces, `backward_carried_bytes` included.
        backward_scratch_pieces: The scratch of each of the call's own kernels
            that hold scratch at the peak of its backward pass (without
            `backward_carried_bytes`), largest first: each is an allocation of
            its own, which the simulator's allocator places apart from the
            rest of the workspace (the gradients of a convolution's input and
            of its filter run side by side on CPU, each with its scratch).
            Empty when none, and in graphs saved before it was recorded.
        backward_carried_bytes: The part of `backward_workspace_bytes` that is
            the scratch of another call's kernel still running beside this
            call's backward: a weight gradient's (a 3x3 `Conv2DBackpropFilter`
            holds about 30 MiB with TensorFlow's own CPU kernels), which no
            input gradient waits for, so the executor goes on beside it. 0
            where the backward pass runs one kernel at a time, and in graphs
            saved before it was recorded.
        backward_carried_from: The id of the call whose kernel that is ("" for
            none). A plan whose units hand on their input gradients only once
            their weight gradients exist (updates in the backward pass, a
            pinned order) leaves no such kernel running beside the calls before
            that call's unit.
        param_bytes: Bytes of the trainable weights whose gradient this call
            produces (0 for later calls of a shared layer).
        flops_forward: Floating point operations of the forward pass.
        flops_backward: Floating point operations of the backward pass.
        seconds_forward: Measured forward time, when measured.
        seconds_backward: Measured backward time, when measured.
        inplace: Whether the call is elementwise, so its output may reuse the
            buffer of its first input (Chen et al. Sec. 3).
        backward_inplace: Whether the call's backward pass writes its input's
            gradient into a buffer that already exists (the incoming gradient,
            as an activation's or a Dropout's elementwise gradient kernels do)
            instead of allocating one.
        saved_apart: Whether the ops making `internal_saved_bytes` neither make
            nor read the call's outputs (a Dropout's mask, the statistics
            Keras's BatchNormalization computes from its input; not what a
            fused kernel such as `FusedBatchNormV3` makes with its output). A
            recompute whose backward reads none of the call's outputs then
            runs only them: TensorFlow prunes the ops whose results nothing
            reads.
        saved_flops: FLOPs of the ops such a recompute runs: those making
            `internal_saved_bytes` and, inside the call, the ops they read
            (a Dropout's random mask; all of an LSTM's loop, which makes the
            saved tensors with its outputs). 0 in graphs saved before it was
            recorded.
        alias_inputs: For each output, the position in `inputs` of the input
            whose buffer it is (a reshape or identity), or None for a new buffer.
            Empty means no output aliases an input.
        duplicate_of: For each output, the reference of an earlier call's
            output that is the same computation on the same tensors (NASNet
            applies a ReLU to one tensor in several branches), or None.
            TensorFlow's graph optimizer runs such duplicates once, into one
            buffer, when both are computed together. Empty means none.

    Example:

    ```python
    graph = tfremat.extract(model, batch_size=16)
    node = graph.node("conv1_conv")
    print(node.class_name, node.outputs[0].shape, node.output_bytes, node.flops_forward)
    ```
    """

    id: str
    layer: str
    class_name: str
    inputs: list[str]
    outputs: list[TensorInfo]
    backward_reads: list[str] = dataclasses.field(default_factory=list)
    backward_reads_released: list[str] = dataclasses.field(default_factory=list)
    internal_saved_bytes: int = 0
    internal_saved_pieces: int = 1
    forward_workspace_bytes: int = 0
    backward_workspace_bytes: int = 0
    backward_scratch_pieces: list[int] = dataclasses.field(default_factory=list)
    backward_carried_bytes: int = 0
    backward_carried_from: str = ""
    param_bytes: int = 0
    flops_forward: float = 0.0
    flops_backward: float = 0.0
    seconds_forward: float | None = None
    seconds_backward: float | None = None
    inplace: bool = False
    backward_inplace: bool = False
    saved_apart: bool = False
    saved_flops: float = 0.0
    alias_inputs: list[int | None] = dataclasses.field(default_factory=list)
    duplicate_of: list[str | None] = dataclasses.field(default_factory=list)

    @property
    def is_input(self) -> bool:
        return self.class_name == "InputLayer"

    @property
    def output_bytes(self) -> int:
        return sum(t.bytes for t in self.outputs)

    def output_ref(self, index: int = 0) -> str:
        return f"{self.id}:{index}"

    @property
    def forward_cost(self) -> float:
        """Seconds when measured, FLOPs otherwise."""
        if self.seconds_forward is not None:
            return self.seconds_forward
        return self.flops_forward

    @property
    def saved_bytes(self) -> int:
        """Bytes this call's backward keeps of its own outputs plus internal tensors."""
        own = {self.output_ref(i) for i in range(len(self.outputs))}
        kept = sum(
            self.outputs[int(r.rsplit(":", 1)[1])].bytes
            for r in set(self.backward_reads)
            if r in own
        )
        return kept + self.internal_saved_bytes


def structure_fingerprint(calls: Iterable[tuple[str, str, list[str]]]) -> str:
    """Hash of `(node id, class name, input refs)` triples, in order."""
    h = hashlib.sha256()
    for node_id, class_name, inputs in calls:
        h.update(repr((node_id, class_name, list(inputs))).encode())
    return h.hexdigest()[:16]


def split_ref(ref: str) -> tuple[str, int]:
    """Splits `"node_id:index"` into its node id and output index."""
    node_id, index = ref.rsplit(":", 1)
    return node_id, int(index)


@dataclasses.dataclass
class PlanGraph:
    """The graph a planner works on: layer calls of one training step.

    Attributes:
        nodes: Nodes in a topological order.
        persistent_bytes: Bytes alive for the whole step, by kind: `"weights"`,
            `"optimizer"` (slots), `"other"` (non-trainable variables, counters),
            `"batch"` (the input batch and targets).
        update_workspace_bytes: Peak transient memory of the optimizer update.
        update_early_bytes: Bytes of the optimizer update's results that do
            not wait for a gradient (SGD with momentum's `m * momentum`,
            RMSprop's `rho * velocity`, one per variable): TensorFlow computes
            them as the step starts and each is held until its variable's
            gradient reaches the update.
        loss_workspace_bytes: Peak transient memory of the loss and its gradient.
        outputs: References of the model outputs (the loss reads them).
        outputs_in_place: The outputs whose gradient the loss writes into the
            output's own buffer when nothing else reads the output any more
            (a softmax cross-entropy on logits does).
        name: Model name.
        metadata: Facts about the step (batch shape, trace time, kernel
            workspaces). The simulator reads three: `"replicas"`, the
            strategy's replicas; `"allocator"`, how the device's allocator
            counts bytes (`tfremat.simulation.ALLOCATORS`; TensorFlow's BFC
            allocator when absent); and `"concurrent_ops"`, whether the device
            runs ready operations side by side (a CPU with several inter-op
            threads; false when absent).

    Example:

    ```python
    graph = tfremat.extract(model, batch_size=16)   # or build one by hand from Nodes
    print(len(graph), graph.total_persistent_bytes / 2**20, "MiB persistent")
    print(tfremat.simulate(graph).peak_mb, "MiB predicted without a plan")
    ```
    """

    nodes: list[Node]
    persistent_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    update_workspace_bytes: int = 0
    update_early_bytes: int = 0
    loss_workspace_bytes: int = 0
    outputs: list[str] = dataclasses.field(default_factory=list)
    outputs_in_place: list[str] = dataclasses.field(default_factory=list)
    name: str = "model"
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {n.id: i for i, n in enumerate(self.nodes)}
        if len(self._index) != len(self.nodes):
            seen: set[str] = set()
            dup = next(n.id for n in self.nodes if n.id in seen or seen.add(n.id))
            raise ValueError(f"Duplicate node id {dup!r} in PlanGraph.")
        for node in self.nodes:
            for ref in node.inputs:
                producer, index = split_ref(ref)
                if producer not in self._index:
                    raise ValueError(
                        f"Node {node.id!r} reads {ref!r} from unknown node."
                    )
                if self._index[producer] >= self._index[node.id]:
                    raise ValueError(
                        f"Nodes are not in topological order: {node.id!r} reads "
                        f"{ref!r} produced later."
                    )
                if index >= len(self.nodes[self._index[producer]].outputs):
                    raise ValueError(f"Node {node.id!r} reads missing output {ref!r}.")
            for i, ref in enumerate(node.duplicate_of):
                if ref is None:
                    continue
                producer, index = split_ref(ref)
                if (i >= len(node.outputs)
                        or self._index.get(producer, len(self.nodes)) >= self._index[node.id]
                        or index >= len(self.nodes[self._index[producer]].outputs)
                        or self.nodes[self._index[producer]].outputs[index].bytes
                        != node.outputs[i].bytes):
                    raise ValueError(f"Node {node.id!r}'s output {i} is said to duplicate "
                                     f"{ref!r}, which is not an earlier output of its size.")
        # Nodes are not changed once in a graph, so lookups are worked out once.
        self._predecessors = {n.id: tuple(dict.fromkeys(split_ref(r)[0] for r in n.inputs))
                              for n in self.nodes}
        self._fingerprint = structure_fingerprint(
            (n.id, n.class_name, n.inputs) for n in self.nodes)

    # -- lookups ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._index

    def node(self, node_id: str) -> Node:
        try:
            return self.nodes[self._index[node_id]]
        except KeyError:
            raise KeyError(f"No node {node_id!r} in graph {self.name!r}.") from None

    def index(self, node_id: str) -> int:
        return self._index[node_id]

    def tensor(self, ref: str) -> TensorInfo:
        node_id, i = split_ref(ref)
        return self.node(node_id).outputs[i]

    def predecessors(self, node_id: str) -> list[str]:
        """Distinct producer ids of a node's inputs, in input order."""
        try:
            return list(self._predecessors[node_id])
        except KeyError:
            raise KeyError(f"No node {node_id!r} in graph {self.name!r}.") from None

    def successors(self) -> dict[str, list[str]]:
        """Map from each node id to the distinct ids of the nodes consuming it."""
        succ: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for p in self.predecessors(n.id):
                succ[p].append(n.id)
        return succ

    def consumers(self) -> dict[str, list[str]]:
        """Map from each tensor reference to the ids of nodes reading it."""
        cons: dict[str, list[str]] = {}
        for n in self.nodes:
            for i in range(len(n.outputs)):
                cons[n.output_ref(i)] = []
        for n in self.nodes:
            for ref in dict.fromkeys(n.inputs):
                cons[ref].append(n.id)
        return cons

    def dropped_bytes(self, node_ids: Sequence[str],
                      consumers: dict[str, list[str]] | None = None) -> int:
        """Bytes a recompute segment of `node_ids` does not keep for the
        backward pass: its calls' outputs that nothing outside it reads (nor
        the model's outputs), and the tensors its calls would keep inside
        (`Node.internal_saved_bytes`, e.g. a subclassed block's intermediates).

        Args:
            node_ids: The ids of the segment's nodes.
            consumers: `self.consumers()`, when the caller has it (it walks
                the whole graph).

        Returns:
            The bytes; 0 for a segment whose every output is read outside it
            (one convolution between two kept tensors), which saves nothing.
        """
        inside = set(node_ids)
        consumers = self.consumers() if consumers is None else consumers
        return sum(
            self.node(n).outputs[i].bytes
            for n in node_ids for i in range(len(self.node(n).outputs))
            if f"{n}:{i}" not in self.outputs
            and all(c in inside for c in consumers[f"{n}:{i}"])) + sum(
            self.node(n).internal_saved_bytes for n in node_ids)

    # -- summaries ---------------------------------------------------------

    @property
    def total_persistent_bytes(self) -> int:
        return sum(self.persistent_bytes.values())

    @property
    def total_flops_forward(self) -> float:
        return sum(n.flops_forward for n in self.nodes)

    @property
    def total_forward_cost(self) -> float:
        return sum(n.forward_cost for n in self.nodes)

    def fingerprint(self) -> str:
        """Hash of the graph's structure: node ids, classes and edges.

        Shapes and costs are left out: a plan stays valid for the same model at
        another batch size (its estimates do not), and the rewriter can check a
        plan against a model without tracing it.
        """
        return self._fingerprint

    # -- JSON --------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "name": self.name,
            "fingerprint": self.fingerprint(),
            "persistent_bytes": dict(self.persistent_bytes),
            "update_workspace_bytes": self.update_workspace_bytes,
            "update_early_bytes": self.update_early_bytes,
            "loss_workspace_bytes": self.loss_workspace_bytes,
            "outputs": list(self.outputs),
            "outputs_in_place": list(self.outputs_in_place),
            "metadata": self.metadata,
            "nodes": [
                {**dataclasses.asdict(n),
                 "outputs": [[list(t.shape), t.dtype, t.bytes] for t in n.outputs]}
                for n in self.nodes
            ],
        }

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int | None = None) -> str:
        """Serialises the graph to JSON, also writing it to `path` if given."""
        return jsonio.dumps(self.to_dict(), path, indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlanGraph":
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"PlanGraph format version {version!r} is not supported "
                f"(this tfremat reads version {FORMAT_VERSION})."
            )
        nodes = []
        try:
            for nd in data["nodes"]:
                nd = dict(nd)
                nd["outputs"] = [TensorInfo(tuple(s), d, b) for s, d, b in nd["outputs"]]
                nodes.append(Node(**nd))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"PlanGraph JSON has malformed nodes ({type(e).__name__}: "
                             f"{e}).") from None
        graph = cls(
            nodes=nodes,
            persistent_bytes=dict(data.get("persistent_bytes", {})),
            update_workspace_bytes=data.get("update_workspace_bytes", 0),
            update_early_bytes=data.get("update_early_bytes", 0),
            loss_workspace_bytes=data.get("loss_workspace_bytes", 0),
            outputs=list(data.get("outputs", [])),
            outputs_in_place=list(data.get("outputs_in_place", [])),
            name=data.get("name", "model"),
            metadata=dict(data.get("metadata", {})),
        )
        stored = data.get("fingerprint")
        if stored is not None and stored != graph.fingerprint():
            raise ValueError("PlanGraph JSON is corrupt: its fingerprint does not match.")
        return graph

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike) -> "PlanGraph":
        """Reads a graph from JSON text or a JSON file.

        Raises:
            ValueError: not an existing file nor JSON text, or not a PlanGraph.
        """
        return cls.from_dict(jsonio.loads(text_or_path, "PlanGraph"))
