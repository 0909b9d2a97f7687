"""The schedule of one training step: its steps, their buffers and their compute time.

The step is unrolled into steps (forward of each layer call, the loss, backward
of each call in reverse order, the optimizer update). With a Plan, each
recompute segment runs its forward without keeping anything inside it, and in
the backward pass runs its forward again (its nested segments again without
keeping; of calls whose outputs its backward does not read, only what their
own backward reads), then its backward. With updates in the backward pass
(`Plan.update_in_backward`), the optimizer update of a layer call runs right
after its backward step and that of a segment after the segment's backward,
each freeing its weight gradients at once (layers called from several units
are still updated at the end). A pinned order (`Plan.pin_order`) times the
updates the same way (`updates_follow_units`), each beside the next step
on a device that runs operations side by side (`updates_overlap`): the next
unit's backward does not wait for it. Otherwise each update starts
once its gradient exists (its workspace counts there) and frees the gradient
`GRADIENT_LIFETIME_STEPS` later. What the update computes before any gradient
(`PlanGraph.update_early_bytes`) lives from the first step until its
gradient is freed; with updates in the backward pass it waits for the unit's
gradients like the rest of the update, and counts in the unit's update. A
call's backward reads that only its first backward ops read
(`Node.backward_reads_released`, a fused activation's output) are read at a
step of their own before its backward step, so they can be freed before its
workspace and input gradients exist. Every
buffer is recorded with the step that makes it and the steps that read it;
`simulator.py` turns that into memory, and `transfers.py` turns the step
times into a timeline with host copies.

No TensorFlow import: planners call this in loops.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from typing import Union

from tfremat.core import (Node, Plan, PlanGraph, Segment, pins_order, recompute_units,
                          updates_in_backward)
from tfremat.simulation.transfers import DEVICE_FLOPS, node_seconds

Key = tuple
_Unit = Union[Node, Segment]


#: Backward steps a weight gradient outlives the step that makes it, before the
#: optimizer's update frees it. TensorFlow applies each update once its gradient
#: exists, but the update waits behind the backward ops already queued on the
#: inter-op threads. Calibrated on CPU: ResNet50 (plain and with sqrt(n)
#: segments) fits its measured peaks with 16-24 steps; the keras.applications
#: models of benchmarks/results/simulator_fidelity.md stay within a few percent.
GRADIENT_LIFETIME_STEPS = 24


def gradient_lifetime(graph: PlanGraph) -> int | None:
    """Backward steps a weight gradient of `graph`'s step outlives the step that
    makes it (`GRADIENT_LIFETIME_STEPS`), or None when every gradient lives
    until the optimizer update.

    A step traced through a strategy with several replicas
    (`graph.metadata["replicas"]`) all-reduces its gradients as one pack that
    concatenates all of them, so none is freed before the update.
    """
    return None if graph.metadata.get("replicas", 1) > 1 else GRADIENT_LIFETIME_STEPS


def updates_follow_units(graph: PlanGraph, plan: Plan | None) -> bool:
    """Whether the optimizer update of each unit of `graph`'s step under `plan`
    (`graph`'s marks without one) runs right after the unit's backward pass,
    freeing its weight gradients.

    With updates in the backward pass they run there. A pinned order
    (`Plan.pin_order`) runs them at the same time on a functional model whose
    gradients are freed before the update of the last one
    (`gradient_lifetime`): TensorFlow runs each variable's update once its
    gradient exists, and the pinned gradient exists once the unit's input
    gradients do (`tfremat.rewriter.BackwardOrder`). Measured: ResNet50's
    sqrt(n) plan, pinned, 197.3 MiB in five fresh processes, as the same plan
    with updates in the backward pass. A subclassed model pins only its
    recomputed sublayer calls.
    """
    updates, pinned = ((updates_in_backward(graph), pins_order(graph)) if plan is None
                       else (plan.update_in_backward, plan.pin_order))
    return updates or (pinned and not graph.metadata.get("subclassed", False)
                       and gradient_lifetime(graph) is not None)


def updates_overlap(graph: PlanGraph, plan: Plan | None) -> bool:
    """Whether each unit's optimizer update of `graph`'s step under `plan`
    runs beside the next step of the backward pass, holding its weight
    gradients and its workspace there.

    So under a pinned order (`Plan.pin_order`) without updates in the backward
    pass, on a device that runs ready operations side by side
    (`"concurrent_ops"` in the graph's metadata, a CPU's inter-op threads):
    the update waits for the unit's input gradients, and so does the next
    unit's backward, which does not wait for the update. Profiled on VGG19's
    chen-greedy plan pinned (96 px, batch 16, SGD): at the measured peak,
    `fc2`'s update (`AssignSubVariableOp`) still ran, its 64 MiB gradient
    live, beside `fc1`'s backward making its own. With updates in the
    backward pass the next unit's backward waits for the update; on a GPU
    the kernels of one stream run one at a time.
    """
    updates = updates_in_backward(graph) if plan is None else plan.update_in_backward
    return (not updates and updates_follow_units(graph, plan)
            and bool(graph.metadata.get("concurrent_ops", False)))


@dataclasses.dataclass(frozen=True)
class Lifetime:
    """When the forward pass's buffer of one tensor is made and read.

    Attributes:
        nbytes: Size of the buffer (0 for InputLayer tensors: they belong to the
            batch, counted as persistent).
        produced: Step that makes it.
        forward_last: Last step up to and including the loss that reads it.
        backward_first: First step after the loss that reads it (a backward
            step, or a forward step recomputing a segment), or None.
        backward_last: Last step after the loss that reads it, or None.
    """

    nbytes: int
    produced: int
    forward_last: int
    backward_first: int | None
    backward_last: int | None


class Schedule:
    """The steps of one training step under a plan's recompute segments.

    Attributes:
        graph: The PlanGraph.
        labels: Label of each step, e.g. `"fwd conv1"`, `"bwd conv1 (first ops)"`,
            `"bwd conv1"`, `"loss"`.
        seconds: Compute time of each step (`transfers.node_seconds`); the loss
            and the optimizer update count 0.
        transient: Transient workspace bytes of each step.
        scratch: For the steps whose workspace holds kernels' scratch
            (`Node.backward_scratch_pieces`), the bytes of each kernel's, an
            allocation of its own. The rest of a step's `transient` is one.
        pieces: Buffers held in several equal allocations, and how many
            (`Node.internal_saved_pieces`); the others are one allocation.
        loss_step: Index of the loss step: steps after it are the backward pass.
        backward_step: Map from node id to the index of its backward step.
        recompute_seconds: Compute time of the recomputed forward calls.
        extra_compute: Cost of the recomputed forward calls, in the graph's cost
            unit (seconds when measured, FLOPs otherwise).
        extra_flops: FLOPs of the recomputed forward calls.
        requires_grad: Whether a gradient flows into each node.
        gradient_lifetime: `gradient_lifetime(graph)`.
        update_in_backward: Whether each unit's optimizer update runs right
            after its backward pass (`updates_follow_units`).
        early_at_updates: Whether the update's early ops
            (`PlanGraph.update_early_bytes`) run in each unit's update, as with
            updates in the backward pass, which wait for the unit's gradients,
            instead of as the step starts.
        overlap_updates: Whether each unit's update (with
            `update_in_backward`) runs beside the next step, its workspace
            counted and its gradients freed there (`updates_overlap`).
    """

    def __init__(self, graph: PlanGraph, device_flops: float = DEVICE_FLOPS,
                 update_in_backward: bool = False, early_at_updates: bool = False,
                 overlap_updates: bool = False) -> None:
        self.graph = graph
        self.device_flops = device_flops
        self.labels: list[str] = []
        self.seconds: list[float] = []
        self.transient: list[int] = []
        self.scratch: dict[int, list[int]] = {}
        self.alloc_step: dict[Key, int] = {}
        self.size: dict[Key, int] = {}
        self.pieces: dict[Key, int] = {}
        self.last_use: dict[Key, int] = {}
        self.forward_last_use: dict[Key, int] = {}
        self.backward_first_use: dict[Key, int] = {}
        self.inplace: list[tuple[int, Key, Key]] = []
        self.partials: dict[str, list[Key]] = {}
        self.weight_grads: list[Key] = []
        self.times_run: dict[str, int] = {}
        self.backward_step: dict[str, int] = {}
        self.loss_step = -1
        self.recompute_seconds = 0.0
        self.extra_compute = 0.0
        self.extra_flops = 0.0
        self.requires_grad = requires_grad(graph)
        self.gradient_lifetime = gradient_lifetime(graph)
        self.top = _Context(None)
        self._segment_units: dict[int, list[_Unit]] = {}
        self._segment_needs: dict[int, tuple[set[str], set[str]]] = {}
        self.update_in_backward = update_in_backward
        self._calls = Counter(n.layer for n in graph)
        # While the backward pass of a top-level segment runs: its layers whose
        # every call is inside it, and the weight gradients they made so far.
        self._unit_layers: set[str] | None = None
        self._unit_grads: list[Key] = []
        self.early_at_updates = early_at_updates
        self._early: dict[str, Key] = {}
        self._early_in_update: dict[str, int] = {}
        self._largest_weights = max((n.param_bytes for n in graph), default=0) or 1
        self.overlap_updates = overlap_updates
        self._overlapping: list[tuple[list[Key], int]] = []
        # Calls whose unit handed on its input gradients after its weight
        # gradients (`update_in_backward`), as their backward passes end.
        self._gated: set[str] = set()
        self._ancestry: dict[tuple[str, str], bool] = {}

    # -- queries -------------------------------------------------------------

    def key_of(self, ref: str) -> Key:
        """The buffer a forward tensor reference lives in (views share one)."""
        return self.top.resolve(ref)

    def lifetimes(self) -> dict[str, Lifetime]:
        """Lifetimes of the buffers the forward pass makes, by tensor reference.

        Tensors inside recompute segments are included: their forward buffer
        is only read in the forward pass (the backward pass reads the
        recomputed one), so `backward_first` is None for them.
        """
        return {ref: self.lifetime(key) for ref, key in self.top.keys.items()
                if key[0] == ref}  # not a view of another tensor's buffer

    def lifetime(self, key: Key) -> Lifetime:
        """The lifetime of one forward buffer (a key from `key_of`)."""
        first = self.backward_first_use.get(key)
        return Lifetime(
            nbytes=self.size[key], produced=self.alloc_step[key],
            forward_last=self.forward_last_use.get(key, self.alloc_step[key]),
            backward_first=first,
            backward_last=None if first is None else self.last_use[key])

    @property
    def baseline_seconds(self) -> float:
        """Compute time of the step without recomputation."""
        return sum(self.seconds) - self.recompute_seconds

    # -- building ------------------------------------------------------------

    def run(self, segments: list[Segment]) -> "Schedule":
        """Records the whole step: forward, loss, backward, optimizer update."""
        top = units(self.graph, [n.id for n in self.graph], segments)
        self._early, self._early_in_update = self._early_update_buffers()
        self.forward(top, self.top, record=True)
        self.loss(self.top)
        self.backward(top, self.top)
        self.update()
        return self

    def _early_update_buffers(self) -> tuple[dict[str, Key], dict[str, int]]:
        """The update's buffers made before any gradient exists
        (`PlanGraph.update_early_bytes`), by the node whose weight gradient
        frees them: the first call of each layer with weights, shared out by
        its weights' bytes (they are one per variable). Returns the keys of
        those allocated at the first step and the bytes of those that count in
        their unit's update instead (`_update_unit`): with `early_at_updates`,
        all but those of layers called more than once (updated after the
        backward pass)."""
        first: dict[str, Node] = {}
        for node in self.graph:
            if node.param_bytes and self.requires_grad[node.id]:
                first.setdefault(node.layer, node)
        total = sum(n.param_bytes for n in first.values())
        if not self.graph.update_early_bytes or not total:
            return {}, {}
        share = {node.id: self.graph.update_early_bytes * node.param_bytes // total
                 for node in first.values()}
        in_update = {n.id: share[n.id] for n in first.values()
                     if self.early_at_updates and self._calls[n.layer] == 1}
        early = [n for n in first.values() if n.id not in in_update]
        if not early:
            return {}, in_update
        step = self._step("update's early ops")
        buffers = {}
        for node in early:
            key = ("update early", node.id)
            self._alloc(key, share[node.id], step)
            buffers[node.id] = key
        return buffers, in_update

    def _free_gradient(self, key: Key, step: int) -> None:
        """Frees a weight gradient at `step`'s update, with the update's early
        buffer for the same weights (`_early_update_buffers`)."""
        self._use(key, step)
        early = self._early.get(key[1])
        if early is not None:
            self._use(early, step)

    def _step(self, label: str, transient: int = 0, seconds: float = 0.0,
              updates_beside: bool = True) -> int:
        """Appends a step; the updates waiting to run beside the next step
        (`overlap_updates`) count in it unless `updates_beside` is False (the
        first ops of a backward step, too short for them)."""
        self.labels.append(label)
        self.transient.append(transient)
        self.seconds.append(seconds)
        step = len(self.labels) - 1
        if self._overlapping and updates_beside:  # updates running beside this step
            for grads, workspace in self._overlapping:
                self.transient[step] += workspace
                for key in grads:
                    self._free_gradient(key, step)
            self._overlapping = []
        return step

    def _alloc(self, key: Key, nbytes: int, step: int) -> None:
        self.alloc_step[key] = step
        self.size[key] = nbytes
        self.last_use[key] = step

    def _use(self, key: Key, step: int) -> None:
        if self.last_use[key] < step:
            self.last_use[key] = step
        if self.loss_step >= 0 and key not in self.backward_first_use:
            self.backward_first_use[key] = step

    def forward(self, unit_list: list[_Unit], ctx: "_Context", record: bool) -> None:
        for unit in unit_list:
            if isinstance(unit, Segment):
                # Inside a recompute segment nothing is recorded for backward.
                self.forward(self._units_of(unit), ctx, record=False)
            else:
                self._forward_node(unit, ctx, record)

    def _units_of(self, segment: Segment) -> list[_Unit]:
        """`units` of a segment's nodes and children, worked out once per segment."""
        if id(segment) not in self._segment_units:
            self._segment_units[id(segment)] = units(self.graph, segment.nodes,
                                                     segment.children)
        return self._segment_units[id(segment)]

    def _forward_node(self, node: Node, ctx: "_Context", record: bool) -> None:
        # Outputs an earlier call computed in this same (re)computation: the
        # graph optimizer runs the two as one, into one buffer.
        same = [ctx.keys.get(r) if r is not None else None for r in node.duplicate_of]
        merged = bool(same) and all(k is not None for k in same)
        runs = self.times_run.get(node.id, 0)
        self.times_run[node.id] = runs + 1
        seconds = 0.0 if merged else node_seconds(node, self.device_flops)[0]
        if runs and not merged:
            self._count_recompute(node, seconds)
        transient = 0 if merged else node.forward_workspace_bytes
        if not record and not merged:
            transient += node.internal_saved_bytes
        step = self._step(f"fwd {node.id}" + ("" if runs == 0 else f" (recompute {runs})"),
                          transient, seconds)
        if merged:
            for i, key in enumerate(same):
                ctx.keys[node.output_ref(i)] = key
            return
        inputs = [ctx.resolve(r) for r in node.inputs]
        for key in inputs:
            self._use(key, step)
        for i, t in enumerate(node.outputs):
            ref = node.output_ref(i)
            alias = node.alias_inputs[i] if node.alias_inputs else None
            if alias is not None:  # a view of an input: same buffer, no allocation
                ctx.keys[ref] = inputs[alias]
                continue
            if same and same[i] is not None:
                ctx.keys[ref] = same[i]
                continue
            key = (ref, ctx.uid)
            self._alloc(key, 0 if node.is_input else t.bytes, step)
            ctx.keys[ref] = key
        if record and node.internal_saved_bytes:
            self._alloc_saved(node, ctx, step)
        if node.inplace and inputs and node.outputs and not (same and same[0] is not None):
            self.inplace.append((step, (node.output_ref(0), ctx.uid), inputs[0]))

    def loss(self, ctx: "_Context") -> None:
        step = self._step("loss", self.graph.loss_workspace_bytes)
        for ref in self.graph.outputs:
            self._use(ctx.resolve(ref), step)
            t = self.graph.tensor(ref)
            if t.differentiable and self.requires_grad[ref.rsplit(":", 1)[0]]:
                key = ("grad", ref, 0)
                self._alloc(key, t.bytes, step)
                self.partials.setdefault(ref, []).append(key)
                if ref in self.graph.outputs_in_place:
                    self.inplace.append((step, key, ctx.resolve(ref)))
        self.loss_step = step
        self.forward_last_use = dict(self.last_use)

    def backward(self, unit_list: list[_Unit], ctx: "_Context") -> None:
        for unit in reversed(unit_list):
            if isinstance(unit, Segment):
                top = self.update_in_backward and self._unit_layers is None
                if top:
                    self._unit_layers = self._own_layers(unit)
                sub = self._units_of(unit)
                inner = _Context(ctx)
                self._recompute(unit, inner)
                self.backward(sub, inner)
                for key in self._segment_inputs(unit, ctx):  # the closure held them so far
                    self._use(key, len(self.labels) - 1)
                if top:
                    self._update_unit(self._unit_grads, len(self.labels) - 1)
                    self._gated.update(key[1] for key in self._unit_grads)
                    self._unit_layers, self._unit_grads = None, []
            elif self.requires_grad[unit.id]:
                self._backward_node(unit, ctx)

    def _recompute(self, segment: Segment, ctx: "_Context") -> None:
        """The forward pass of `segment` again, before its backward pass: the
        calls its backward needs (`_needed`), and of the others only what their
        own backward reads."""
        runs, saved_only = self._needed(segment)
        for unit in self._units_of(segment):
            if isinstance(unit, Segment):
                self.forward(self._units_of(unit), ctx, record=False)
            elif unit.id in runs:
                self._forward_node(unit, ctx, record=True)
            elif unit.id in saved_only:
                self._saved_only(unit, ctx)

    def _needed(self, segment: Segment) -> tuple[set[str], set[str]]:
        """The calls of `segment` whose recompute runs (those whose outputs its
        backward pass reads, directly or through other calls that run, and
        every call of a nested segment), and those of which it runs only the
        ops making what their backward reads (`Node.saved_apart`).

        TensorFlow prunes from the recompute the ops whose results nothing
        reads: the backward of a segment ending in a Dropout reads its mask,
        not its output, and the Dropout's multiplication is not run again (a
        small CNN's four-Dropout plan was predicted at 150.2 MiB with it,
        measured 108.3)."""
        if id(segment) in self._segment_needs:
            return self._segment_needs[id(segment)]
        reads = {r for n in segment.nodes for r in self.graph.node(n).backward_reads}
        runs: set[str] = set()
        saved_only: set[str] = set()
        for unit in reversed(self._units_of(segment)):
            if isinstance(unit, Segment):
                runs.update(unit.nodes)
                inside = set(unit.nodes)
                reads.update(r for n in unit.nodes for r in self.graph.node(n).inputs
                             if r.rsplit(":", 1)[0] not in inside)
                continue
            backward = self.requires_grad[unit.id] and unit.internal_saved_bytes > 0
            if any(unit.output_ref(i) in reads for i in range(len(unit.outputs))) or (
                    backward and not unit.saved_apart):
                runs.add(unit.id)
                reads.update(unit.inputs)
            elif backward:  # its saved tensors may be made from its inputs
                saved_only.add(unit.id)
                reads.update(unit.inputs)
        self._segment_needs[id(segment)] = runs, saved_only
        return runs, saved_only

    def _saved_only(self, node: Node, ctx: "_Context") -> None:
        """Recomputes only what `node`'s backward reads of its own making."""
        runs = self.times_run.get(node.id, 0)
        self.times_run[node.id] = runs + 1
        # The share of the call's forward those ops are (all of an LSTM's).
        share = min(1.0, node.saved_flops / node.flops_forward) if node.flops_forward else 0.0
        seconds = share * node_seconds(node, self.device_flops)[0]
        self._count_recompute(node, seconds, share)
        self._alloc_saved(node, ctx, self._step(
            f"fwd {node.id} (recompute {runs}, saved tensors only)", seconds=seconds))

    def _count_recompute(self, node: Node, seconds: float, share: float = 1.0) -> None:
        """Counts a recompute of `share` of `node`'s forward pass, taking
        `seconds`, as extra compute."""
        self.extra_compute += share * node.forward_cost
        self.extra_flops += share * node.flops_forward
        self.recompute_seconds += seconds

    def _alloc_saved(self, node: Node, ctx: "_Context", step: int) -> None:
        """Allocates at `step` the tensors of `node`'s own making that its
        backward reads (`internal_saved_bytes`, in its pieces)."""
        key = (node.id + "#saved", ctx.uid)
        self._alloc(key, node.internal_saved_bytes, step)
        if node.internal_saved_pieces > 1:
            self.pieces[key] = node.internal_saved_pieces
        ctx.saved[node.id] = key

    def _segment_inputs(self, segment: Segment, ctx: "_Context") -> list[Key]:
        """The keys of a segment's inputs from outside it, which its recompute
        reads in place (the rewriter hands them on through an `IdentityN` that
        waits for the gradients, no copy) and its closure holds until the
        segment's backward ends."""
        inside = set(segment.nodes)
        refs = [r for n in segment.nodes for r in self.graph.node(n).inputs
                if r.rsplit(":", 1)[0] not in inside]
        return [ctx.resolve(r) for r in dict.fromkeys(refs)]

    def _backward_workspace(self, node: Node) -> int:
        """`node`'s backward workspace, without the scratch of another call's
        kernel (`Node.backward_carried_bytes`) when that call's unit has handed
        on its input gradients only once its weight gradients existed (updates
        in the backward pass, a pinned order) and `node` is before it: its
        backward starts after that kernel ended. Measured on a Sequential CNN
        (three 3x3 convolutions of 64 channels at 64 and 32 px, batch 16): 137.9
        MiB plain (the largest of 30 steps), 92.2-93.1 with updates in the
        backward pass or a pinned order; predicted 129.8-130.2 for each before,
        96.0-96.3 for those two now."""
        source = node.backward_carried_from
        if source in self._gated and self._before(node.id, source):
            return node.backward_workspace_bytes - node.backward_carried_bytes
        return node.backward_workspace_bytes

    def _split_workspace(self, step: int, node: Node) -> None:
        """Records the scratch of each of `node`'s kernels at the peak of its
        backward pass (`Node.backward_scratch_pieces`) as allocations of their
        own in `step`'s workspace."""
        if node.backward_scratch_pieces and sum(node.backward_scratch_pieces) <= \
                self.transient[step]:
            self.scratch[step] = list(node.backward_scratch_pieces)

    def _before(self, node_id: str, later: str) -> bool:
        """Whether `node_id` is an ancestor of `later` in the forward graph."""
        key = (node_id, later)
        if key not in self._ancestry:
            seen, todo = {later}, [later]
            while todo and node_id not in seen:
                for p in self.graph.predecessors(todo.pop()):
                    if p not in seen:
                        seen.add(p)
                        todo.append(p)
            self._ancestry[key] = node_id in seen
        return self._ancestry[key]

    def _backward_node(self, node: Node, ctx: "_Context") -> None:
        released = set(node.backward_reads_released)
        first = None
        if released:  # its first ops, which read them and allocate nothing
            first = self._step(f"bwd {node.id} (first ops)", updates_beside=False)
            for ref in released:
                self._use(ctx.resolve(ref), first)
        step = self._step(f"bwd {node.id}", self._backward_workspace(node),
                          node_seconds(node, self.device_flops)[1])
        self._split_workspace(step, node)
        self.backward_step[node.id] = step
        incoming: Key | None = None  # the output's gradient, when one buffer
        at = step if first is None else first
        for i, t in enumerate(node.outputs):
            parts = self.partials.pop(node.output_ref(i), [])
            for key in parts:
                self._use(key, at)
            if len(parts) > 1:  # AddN of the partial gradients
                incoming = ("grad-sum", node.output_ref(i))
                self._alloc(incoming, t.bytes, at)
            elif parts:
                incoming = parts[0]
            if parts:  # the first ops write into it what the rest reads
                self._use(incoming, step)
        for ref in node.backward_reads:
            if ref not in released:
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
                if (node.backward_inplace and incoming is not None
                        and self.size.get(incoming) == t.bytes):
                    self.inplace.append((step, key, incoming))
        # The optimizer's update frees a weight gradient some steps after it is made.
        while (self.gradient_lifetime is not None
               and len(self.weight_grads) >= self.gradient_lifetime):
            self._free_gradient(self.weight_grads.pop(0), step)
        if node.param_bytes:
            key = ("wgrad", node.id)
            self._alloc(key, node.param_bytes, step)
            if not self.update_in_backward or self._calls[node.layer] > 1 and (
                    self._unit_layers is None or node.layer not in self._unit_layers):
                self.weight_grads.append(key)  # updated after the backward pass
                if self.gradient_lifetime is not None and self._calls[node.layer] == 1:
                    # TensorFlow starts the update once the gradient exists.
                    self.transient[step] += self._update_workspace(node.param_bytes)
            elif self._unit_layers is not None:
                self._unit_grads.append(key)  # updated after its segment's backward
            else:
                self._update_unit([key], step)
                self._gated.add(node.id)

    def _own_layers(self, segment: Segment) -> set[str]:
        """The layers every call of which is inside `segment`."""
        inside = Counter(self.graph.node(n).layer for n in segment.nodes)
        return {layer for layer, k in inside.items() if k == self._calls[layer]}

    def _update_workspace(self, nbytes: int) -> int:
        """The workspace of the update of `nbytes` of weights: the whole
        update's (`PlanGraph.update_workspace_bytes`, the peak of its traced
        ops, which the largest weights set), in proportion to the largest
        call's weights. Measured alone on one 64 MiB variable: SGD 64 MiB
        (one `lr * g`, written into the gradient in a step), with momentum
        and Adam 128, RMSprop 192."""
        whole = self.graph.update_workspace_bytes
        return min(whole, whole * nbytes // self._largest_weights)

    def _update_unit(self, grads: list[Key], step: int) -> None:
        """The optimizer update of one unit's weight gradients, at the end of
        `step`: its workspace (`_update_workspace`) and, with
        `early_at_updates`, its early ops' buffers count there, and the
        gradients are freed after it; with `overlap_updates`, all of that in
        the next step instead (`_step`)."""
        if not grads:
            return
        workspace = (self._update_workspace(sum(self.size[k] for k in grads))
                     + sum(self._early_in_update.get(k[1], 0) for k in grads))
        if self.overlap_updates:
            self._overlapping.append((grads, workspace))
            return
        self.transient[step] += workspace
        for key in grads:
            self._free_gradient(key, step)

    def update(self) -> None:
        step = self._step("optimizer update", self.graph.update_workspace_bytes)
        for key in self.weight_grads:
            self._free_gradient(key, step)


def build_schedule(graph: PlanGraph, plan: Plan | None = None, *,
                   device_flops: float = DEVICE_FLOPS) -> Schedule:
    """Unrolls one training step of `graph` under `plan`'s recompute segments.

    Args:
        graph: The PlanGraph.
        plan: Optional Plan made for `graph` (its offloaded tensors do not
            change the schedule, only memory and time). Without one, updates
            run in the backward pass when `graph` is marked for them
            (`tfremat.core.with_updates_in_backward`).
        device_flops: FLOP/s of the device, for calls without measured times.

    Returns:
        The `Schedule`.

    Raises:
        PlanMismatchError: the plan was made for another graph.
    """
    if plan is not None:
        plan.check_graph(graph)
    in_backward = plan.update_in_backward if plan is not None else updates_in_backward(graph)
    return Schedule(graph, device_flops, updates_follow_units(graph, plan),
                    early_at_updates=in_backward,
                    overlap_updates=updates_overlap(graph, plan)).run(
        recompute_units(graph, plan.segments) if plan is not None else [])


class _Context:
    """Where tensor references resolve: one per (re)computation of a region."""

    __slots__ = ("parent", "keys", "saved", "uid")
    _next = 0

    def __init__(self, parent: "_Context | None") -> None:
        self.parent = parent
        self.keys: dict[str, Key] = {}
        self.saved: dict[str, Key] = {}
        _Context._next += 1
        self.uid = _Context._next

    def resolve(self, ref: str) -> Key:
        ctx: _Context | None = self
        while ctx is not None:
            key = ctx.keys.get(ref)
            if key is not None:
                return key
            ctx = ctx.parent
        raise KeyError(ref)


def requires_grad(graph: PlanGraph) -> dict[str, bool]:
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


def units(graph: PlanGraph, node_ids: list[str], segments: list[Segment]) -> list[_Unit]:
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
