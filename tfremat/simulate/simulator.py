"""Liveness simulation of one training step over a PlanGraph, with or without a Plan.

The step is unrolled into a schedule of steps (forward of each layer call, the
loss, backward of each call in reverse order, the optimizer update). With a Plan,
each recompute segment runs its forward without keeping anything inside it, and
in the backward pass runs its forward again (its nested segments again without
keeping), then its backward. Every buffer lives from the step that makes it to
the last step that reads it; the peak is the largest sum of live buffers plus the
step's transient workspace (Chen et al. 2016 Sec. 3; the MXNet memory note).

Strategies (the MXNet note's "memory cost estimation"):
    "none": nothing is ever freed or shared.
    "inplace": nothing is freed, but an elementwise call whose input has no
        other pending reader writes its output into that input's buffer.
    "sharing": buffers are freed after their last reader and their memory is
        reused (TensorFlow's reference counting), plus in-place.

No TensorFlow import: planners call this in loops.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Union

from tfremat.graph.plan_graph import Node, PlanGraph
from tfremat.planners.plan import Plan, Segment

STRATEGIES = ("none", "inplace", "sharing")

_Key = tuple
_Unit = Union[Node, Segment]


@dataclasses.dataclass
class Estimate:
    """The simulator's prediction for one training step.

    Attributes:
        peak_bytes: Predicted device peak, persistent bytes included.
        persistent_bytes: Weights, optimizer slots, other variables and the batch.
        activation_peak_bytes: `peak_bytes - persistent_bytes`.
        timeline: `(step label, live bytes)` for every step of the schedule,
            persistent bytes included.
        peak_step: Label of the step where the peak occurs.
        base_compute: Forward plus backward cost of the step without a plan
            (seconds when the graph has measured times, FLOPs otherwise).
        extra_compute: Cost of the recomputed forward calls, same unit.
        extra_flops: FLOPs of the recomputed forward calls.
        strategy: The memory strategy simulated.
        host_peak_bytes: Predicted host memory of offloaded tensors.
    """

    peak_bytes: int
    persistent_bytes: int
    activation_peak_bytes: int
    timeline: list[tuple[str, int]]
    peak_step: str
    base_compute: float
    extra_compute: float
    extra_flops: float
    strategy: str
    host_peak_bytes: int = 0

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20

    @property
    def overhead(self) -> float:
        """Extra compute as a fraction of the step's compute."""
        return self.extra_compute / self.base_compute if self.base_compute else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "persistent_bytes": self.persistent_bytes,
            "activation_peak_bytes": self.activation_peak_bytes,
            "peak_step": self.peak_step,
            "base_compute": self.base_compute,
            "extra_compute": self.extra_compute,
            "extra_flops": self.extra_flops,
            "overhead": self.overhead,
            "strategy": self.strategy,
            "host_peak_bytes": self.host_peak_bytes,
        }


def simulate(graph: PlanGraph, plan: Plan | None = None, *,
             strategy: str = "sharing") -> Estimate:
    """Predicts the device memory of one training step.

    Args:
        graph: The PlanGraph of the step.
        plan: Optional Plan; its recompute segments (nested ones included) are
            simulated. The plan must have been made for `graph`.
        strategy: `"sharing"` (TensorFlow's behaviour, the default), `"inplace"`
            or `"none"`; see the module docstring.

    Returns:
        An `Estimate`.

    Example:

    >>> est = tfremat.simulate(graph, plan)
    >>> print(f"{est.peak_mb:.0f} MiB, +{est.overhead:.0%} compute")
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of {STRATEGIES}.")
    segments: list[Segment] = []
    if plan is not None:
        plan.check_graph(graph)
        segments = plan.segments
    schedule = _Schedule(graph)
    top = _units(graph, [n.id for n in graph], segments)
    ctx = _Context(None)
    schedule.forward(top, ctx, record=True)
    schedule.loss(ctx)
    schedule.backward(top, ctx)
    schedule.update()
    return schedule.estimate(strategy)


class _Context:
    """Where tensor references resolve: one per (re)computation of a region."""

    __slots__ = ("parent", "keys", "saved", "uid")
    _next = 0

    def __init__(self, parent: "_Context | None") -> None:
        self.parent = parent
        self.keys: dict[str, _Key] = {}
        self.saved: dict[str, _Key] = {}
        _Context._next += 1
        self.uid = _Context._next

    def resolve(self, ref: str) -> _Key:
        ctx: _Context | None = self
        while ctx is not None:
            key = ctx.keys.get(ref)
            if key is not None:
                return key
            ctx = ctx.parent
        raise KeyError(ref)


class _Schedule:
    def __init__(self, graph: PlanGraph) -> None:
        self.graph = graph
        self.labels: list[str] = []
        self.transient: list[int] = []
        self.alloc_step: dict[_Key, int] = {}
        self.size: dict[_Key, int] = {}
        self.last_use: dict[_Key, int] = {}
        self.inplace: list[tuple[int, _Key, _Key]] = []
        self.partials: dict[str, list[_Key]] = {}
        self.weight_grads: list[_Key] = []
        self.times_run: dict[str, int] = {}
        self.extra_compute = 0.0
        self.extra_flops = 0.0
        self.requires_grad = _requires_grad(graph)

    # -- schedule building ---------------------------------------------------

    def _step(self, label: str, transient: int = 0) -> int:
        self.labels.append(label)
        self.transient.append(transient)
        return len(self.labels) - 1

    def _alloc(self, key: _Key, nbytes: int, step: int) -> None:
        self.alloc_step[key] = step
        self.size[key] = nbytes
        self.last_use[key] = step

    def _use(self, key: _Key, step: int) -> None:
        if self.last_use[key] < step:
            self.last_use[key] = step

    def forward(self, units: list[_Unit], ctx: _Context, record: bool) -> None:
        for unit in units:
            if isinstance(unit, Segment):
                # Inside a recompute segment nothing is recorded for backward.
                sub = _units(self.graph, unit.nodes, unit.children)
                self.forward(sub, ctx, record=False)
            else:
                self._forward_node(unit, ctx, record)

    def _forward_node(self, node: Node, ctx: _Context, record: bool) -> None:
        runs = self.times_run.get(node.id, 0)
        self.times_run[node.id] = runs + 1
        if runs:
            self.extra_compute += node.forward_cost
            self.extra_flops += node.flops_forward
        transient = node.forward_workspace_bytes
        if not record:
            transient += node.internal_saved_bytes
        step = self._step(f"fwd {node.id}" + ("" if runs == 0 else f" (recompute {runs})"),
                          transient)
        inputs = [ctx.resolve(r) for r in node.inputs]
        for key in inputs:
            self._use(key, step)
        for i, t in enumerate(node.outputs):
            ref = node.output_ref(i)
            alias = node.alias_inputs[i] if node.alias_inputs else None
            if alias is not None:  # a view of an input: same buffer, no allocation
                ctx.keys[ref] = inputs[alias]
                continue
            key = (ref, ctx.uid)
            self._alloc(key, 0 if node.is_input else t.bytes, step)
            ctx.keys[ref] = key
        if record and node.internal_saved_bytes:
            key = (node.id + "#saved", ctx.uid)
            self._alloc(key, node.internal_saved_bytes, step)
            ctx.saved[node.id] = key
        if node.inplace and inputs and node.outputs:
            self.inplace.append((step, (node.output_ref(0), ctx.uid), inputs[0]))

    def loss(self, ctx: _Context) -> None:
        step = self._step("loss", self.graph.loss_workspace_bytes)
        for ref in self.graph.outputs:
            self._use(ctx.resolve(ref), step)
            t = self.graph.tensor(ref)
            if t.differentiable and self.requires_grad[ref.rsplit(":", 1)[0]]:
                key = ("grad", ref, 0)
                self._alloc(key, t.bytes, step)
                self.partials.setdefault(ref, []).append(key)

    def backward(self, units: list[_Unit], ctx: _Context) -> None:
        for unit in reversed(units):
            if isinstance(unit, Segment):
                sub = _units(self.graph, unit.nodes, unit.children)
                inner = _Context(ctx)
                self.forward(sub, inner, record=True)
                self.backward(sub, inner)
            elif self.requires_grad[unit.id]:
                self._backward_node(unit, ctx)

    def _backward_node(self, node: Node, ctx: _Context) -> None:
        step = self._step(f"bwd {node.id}", node.backward_workspace_bytes)
        for i, t in enumerate(node.outputs):
            parts = self.partials.pop(node.output_ref(i), [])
            for key in parts:
                self._use(key, step)
            if len(parts) > 1:  # AddN of the partial gradients
                self._alloc(("grad-sum", node.output_ref(i)), t.bytes, step)
        for ref in node.backward_reads:
            self._use(ctx.resolve(ref), step)
        saved = ctx.saved.get(node.id)
        if saved is not None:
            self._use(saved, step)
        for ref in dict.fromkeys(node.inputs):
            producer, _ = ref.rsplit(":", 1)
            t = self.graph.tensor(ref)
            if self.requires_grad[producer] and t.differentiable:
                parts = self.partials.setdefault(ref, [])
                key = ("grad", ref, len(parts))
                self._alloc(key, t.bytes, step)
                parts.append(key)
        if node.param_bytes:
            key = ("wgrad", node.id)
            self._alloc(key, node.param_bytes, step)
            self.weight_grads.append(key)

    def update(self) -> None:
        step = self._step("optimizer update", self.graph.update_workspace_bytes)
        for key in self.weight_grads:
            self._use(key, step)

    # -- evaluation ------------------------------------------------------------

    def estimate(self, strategy: str) -> Estimate:
        n = len(self.labels)
        delta = [0] * (n + 1)
        keep_all = strategy != "sharing"
        for key, start in self.alloc_step.items():
            nbytes = self.size[key]
            if not nbytes:
                continue
            delta[start] += nbytes
            if not keep_all:
                delta[min(self.last_use[key], n - 1) + 1] -= nbytes
        if strategy != "none":
            for step, out_key, in_key in self.inplace:
                if self.last_use.get(in_key) != step or not self.size.get(in_key):
                    continue
                shared = min(self.size[in_key], self.size[out_key])
                delta[step] -= shared
                if not keep_all:
                    delta[step + 1] += shared
        persistent = self.graph.total_persistent_bytes
        live = 0
        peak, peak_at = 0, 0
        timeline = []
        spent_transient = 0
        for i in range(n):
            live += delta[i]
            if keep_all:
                # With no freeing, workspaces are allocations that stay too.
                here = live + spent_transient + self.transient[i]
                spent_transient += self.transient[i]
            else:
                here = live + self.transient[i]
            timeline.append((self.labels[i], persistent + here))
            if here > peak:
                peak, peak_at = here, i
        base = sum(nd.forward_cost + _backward_cost(nd) for nd in self.graph)
        return Estimate(
            peak_bytes=persistent + peak,
            persistent_bytes=persistent,
            activation_peak_bytes=peak,
            timeline=timeline,
            peak_step=self.labels[peak_at] if n else "",
            base_compute=base,
            extra_compute=self.extra_compute,
            extra_flops=self.extra_flops,
            strategy=strategy,
        )


def _backward_cost(node: Node) -> float:
    if node.seconds_backward is not None:
        return node.seconds_backward
    return node.flops_backward


def _requires_grad(graph: PlanGraph) -> dict[str, bool]:
    """Whether a gradient flows into each node: it or an ancestor has weights.

    Every call of a layer with weights counts, later calls of a shared layer
    (whose `param_bytes` is 0) included.
    """
    layers_with_params = {n.layer for n in graph if n.param_bytes}
    req: dict[str, bool] = {}
    for node in graph:
        req[node.id] = (not node.is_input) and (
            node.layer in layers_with_params
            or any(req[p] for p in graph.predecessors(node.id)))
    return req


def _units(graph: PlanGraph, node_ids: list[str], segments: list[Segment]) -> list[_Unit]:
    """Orders a region's nodes with each segment contracted to one unit.

    A convex segment contracts to a node of a DAG; Kahn's algorithm with the
    smallest original index first keeps the order close to the graph's.
    """
    owner: dict[str, int] = {}
    for s_idx, seg in enumerate(segments):
        for nid in seg.nodes:
            owner[nid] = s_idx
    unit_of = {nid: ("s", owner[nid]) if nid in owner else ("n", nid) for nid in node_ids}
    members: dict[tuple, list[str]] = {}
    for nid in node_ids:
        members.setdefault(unit_of[nid], []).append(nid)
    indeg = {u: 0 for u in members}
    succ: dict[tuple, set] = {u: set() for u in members}
    for nid in node_ids:
        u = unit_of[nid]
        for p in graph.predecessors(nid):
            pu = unit_of.get(p)
            if pu is None or pu == u or u in succ[pu]:
                continue
            succ[pu].add(u)
            indeg[u] += 1
    rank = {u: min(graph.index(m) for m in ms) for u, ms in members.items()}
    heap = [(rank[u], u) for u, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    out: list[_Unit] = []
    while heap:
        _, u = heapq.heappop(heap)
        if u[0] == "s":
            out.append(segments[u[1]])
        else:
            out.append(graph.node(u[1]))
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (rank[v], v))
    if len(out) != len(members):
        raise ValueError("Segments are not convex: contracting them makes a cycle.")
    return out
