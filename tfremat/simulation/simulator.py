"""Simulation of one training step over a PlanGraph, with or without a Plan.

The step is unrolled into a schedule (`schedule.py`): forward of each layer call,
the loss, backward of each call in reverse order, the optimizer update, with
recompute segments run again in the backward pass. Every buffer lives from the
step that makes it to the last step that reads it (Chen et al. 2016 Sec. 3; the
MXNet memory note), beside the step's transient workspace.

Sharing modes (the MXNet note's "memory cost estimation"):
    "none": nothing is ever freed or shared.
    "inplace": nothing is freed, but an elementwise call whose input has no
        other pending reader writes its output into that input's buffer, and
        so does the loss with the gradient of an output in
        `PlanGraph.outputs_in_place`.
    "sharing": buffers are freed after their last reader and their memory is
        reused (TensorFlow's reference counting), plus in-place; where the
        device runs ready operations side by side, what a weights' gradient
        kernel reads is freed after the next step (`_overlapped_frees`). The bytes are
        those of the chunks TensorFlow's BFC allocator hands out for them
        (`allocator.py`), which is what the device's peak statistic counts,
        unless the graph says its device's allocator is another (`ALLOCATORS`).

Offloaded tensors (the Plan's `offloaded`) are played on two copy streams
beside compute (`transfers.py`). An offloaded tensor's device buffer lives from
the step making it until its forward readers are done AND its device-to-host
copy has completed (a copy in flight holds the buffer); a second device buffer
lives from the step that triggers the copy back (`Offload.prefetch_after`'s
backward step, or the first backward reader when None) to its last backward
reader. A buffer offloaded by an elementwise reader is never overwritten in
place. A recompute segment's input may be offloaded: its first backward reader
is the segment's recomputation.

No TensorFlow import: planners call this in loops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tfremat.core import (Node, Offload, Plan, PlanEstimate, PlanGraph, PlanValidationError,
                          validate_plan)
from tfremat.simulation.allocator import WHOLE_DEVICE_BYTES, BFCAllocator
from tfremat.simulation.schedule import Key, Schedule, build_schedule
from tfremat.simulation.transfers import (BANDWIDTH_GBPS, DEVICE_FLOPS, Timing, Transfer,
                                        run_timeline)

#: How buffers are reused, from none to what TensorFlow does.
SHARING_MODES = ("none", "inplace", "sharing")
#: How a device's allocator counts the buffers' bytes under "sharing"
#: (`PlanGraph.metadata["allocator"]`): "bfc", the chunks TensorFlow's BFC
#: allocator hands out from regions it takes as it grows (`allocator.py`: a
#: CPU's, a GPU's with memory growth on); "bfc-one-region", its chunks carved
#: from one region of all the device's memory (a GPU's without memory growth,
#: TensorFlow's default); or None, the bytes the buffers ask for (an allocator
#: that gives each request its own size, such as CUDA's `cuda_malloc_async`).
ALLOCATORS = ("bfc", "bfc-one-region", None)


@dataclasses.dataclass
class Estimate:
    """The simulator's prediction for one training step.

    Attributes:
        peak_bytes: Predicted device peak, persistent bytes included.
        persistent_bytes: Weights, optimizer slots, other variables and the batch.
        activation_peak_bytes: `peak_bytes - persistent_bytes`.
        timeline: `(step label, bytes in use)` for every step of the schedule,
            persistent bytes included (the allocator's chunks under "sharing").
        peak_step: Label of the step where the peak occurs.
        base_compute: Forward plus backward cost of the step without a plan
            (seconds when the graph has measured times, FLOPs otherwise).
        extra_compute: Cost of the recomputed forward calls, same unit.
        extra_flops: FLOPs of the recomputed forward calls.
        sharing: The sharing mode simulated (`SHARING_MODES`).
        allocator: The allocator simulated (`ALLOCATORS`).
        host_peak_bytes: Predicted host memory of offloaded tensors.
        step_seconds: Predicted time of the step: compute, recomputation and
            stalls waiting for copies back (see `transfers.py` for the model).
        baseline_seconds: Predicted time of the step without a plan.
        stall_seconds: Time compute waits for copies back to the device.
        step_times: `(start, end)` seconds of each step of the schedule.

    Example:

    ```python
    est = tfremat.simulate(graph, plan)
    print(f"{est.peak_mb:.0f} MiB at {est.peak_step!r}, +{est.overhead:.0%} compute")
    label, live_bytes = max(est.timeline, key=lambda step: step[1])
    ```
    """

    peak_bytes: int
    persistent_bytes: int
    activation_peak_bytes: int
    timeline: list[tuple[str, int]]
    peak_step: str
    base_compute: float
    extra_compute: float
    extra_flops: float
    sharing: str
    allocator: str | None
    host_peak_bytes: int = 0
    step_seconds: float = 0.0
    baseline_seconds: float = 0.0
    stall_seconds: float = 0.0
    step_times: list[tuple[float, float]] = dataclasses.field(default_factory=list)

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20

    @property
    def overhead(self) -> float:
        """Extra compute as a fraction of the step's compute, plus stalls as a
        fraction of the step's time."""
        compute = self.extra_compute / self.base_compute if self.base_compute else 0.0
        stalls = self.stall_seconds / self.baseline_seconds if self.baseline_seconds else 0.0
        return compute + stalls

    def plan_estimate(self, *, with_time: bool = False, note: str = "",
                      details: dict[str, Any] | None = None) -> PlanEstimate:
        """The figures a Plan records of this prediction.

        Args:
            with_time: Also record the step, baseline and stall seconds (plans
                with offload, whose cost is time rather than compute).
            note: How the plan was chosen.
            details: The planner's own figures.
        """
        timing = {}
        if with_time:
            timing = {"step_seconds": self.step_seconds,
                      "baseline_seconds": self.baseline_seconds,
                      "stall_seconds": self.stall_seconds}
        return PlanEstimate(peak_bytes=self.peak_bytes, overhead=self.overhead,
                            extra_compute=self.extra_compute,
                            host_peak_bytes=self.host_peak_bytes, note=note,
                            details=dict(details or {}), **timing)

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
            "sharing": self.sharing,
            "allocator": self.allocator,
            "host_peak_bytes": self.host_peak_bytes,
            "step_seconds": self.step_seconds,
            "baseline_seconds": self.baseline_seconds,
            "stall_seconds": self.stall_seconds,
        }


def simulate(graph: PlanGraph, plan: Plan | None = None, *, sharing: str = "sharing",
             bandwidth_gbps: float = BANDWIDTH_GBPS, device_flops: float = DEVICE_FLOPS,
             validate: bool = True) -> Estimate:
    """Predicts the device memory, host memory and time of one training step.

    Args:
        graph: The PlanGraph of the step.
        plan: Optional Plan; its recompute segments (nested ones included) and
            offloaded tensors are simulated. The plan must have been made for
            `graph`.
        sharing: `"sharing"` (TensorFlow's behaviour, the default), `"inplace"`
            or `"none"`; see the module docstring. Under `"sharing"` the bytes
            are counted as the graph's device's allocator counts them
            (`graph.metadata["allocator"]`, `ALLOCATORS`; BFC when absent).
        bandwidth_gbps: Bandwidth of each copy stream (device to host, host to
            device) in GB/s (1e9 bytes per second).
        device_flops: FLOP/s of the device, for calls without measured times.
        validate: Check the plan first (`tfremat.core.validate_plan`). Planners
            simulating plans they have already checked pass False.

    Returns:
        An `Estimate`.

    Raises:
        ValueError: unknown sharing mode or allocator.
        PlanMismatchError: the plan was made for another graph.
        PlanValidationError: the plan breaks a rule of `validate_plan`, or a
            prefetch trigger has no backward step or runs after the tensor's
            first backward reader.

    Example:

    >>> est = tfremat.simulate(graph, plan)
    >>> print(f"{est.peak_mb:.0f} MiB, +{est.overhead:.0%} time")
    """
    if sharing not in SHARING_MODES:
        raise ValueError(f"Unknown sharing mode {sharing!r}; choose one of {SHARING_MODES}.")
    allocator = graph.metadata.get("allocator", "bfc")
    if allocator not in ALLOCATORS:
        raise ValueError(f"Unknown allocator {allocator!r} in the graph's metadata; "
                         f"tfremat knows {ALLOCATORS}.")
    if plan is not None and validate:
        plan = plan.for_graph(graph)
        validate_plan(plan, graph)
    schedule = build_schedule(graph, plan, device_flops=device_flops)
    keys, transfers = _transfers(schedule, plan.offloaded if plan is not None else [])
    timing = run_timeline(schedule.seconds, transfers, bandwidth_gbps * 1e9)
    return _estimate(schedule, sharing, allocator, keys, transfers, timing)


def _transfers(schedule: Schedule, offloaded: list[Offload]
               ) -> tuple[list[Key], list[Transfer]]:
    """The buffers of the offloaded tensors and their copies."""
    keys: list[Key] = []
    transfers: list[Transfer] = []
    for off in offloaded:
        try:
            key = schedule.key_of(off.tensor)
        except KeyError:
            raise PlanValidationError(
                f"Offloaded tensor {off.tensor!r} is not in the graph.") from None
        if key in keys:  # a view of a buffer already offloaded
            continue
        life = schedule.lifetime(key)
        first = life.backward_first
        trigger = first
        if first is not None and off.prefetch_after is not None:
            trigger = schedule.backward_step.get(off.prefetch_after)
            if trigger is None:
                raise PlanValidationError(
                    f"Prefetch trigger {off.prefetch_after!r} of {off.tensor!r} has no "
                    "backward step (no gradient flows into it): choose a node whose "
                    "backward pass runs.")
            if trigger > first:
                raise PlanValidationError(
                    f"Prefetch trigger {off.prefetch_after!r} of {off.tensor!r} runs "
                    f"after the tensor's first backward reader "
                    f"({schedule.labels[first]!r}): the copy would come back too late.")
        keys.append(key)
        transfers.append(Transfer(life.nbytes, life.produced, trigger, first))
    return keys, transfers


def _estimate(schedule: Schedule, sharing: str, allocator: str | None, keys: list[Key],
              transfers: list[Transfer], timing: Timing) -> Estimate:
    """Device memory per step, with the offloaded buffers' shortened lives."""
    ends: dict[Key, int] = {}
    extra: list[tuple[int, int, int]] = []  # copies back: (first step, last step, bytes)
    for key, tr, d2h_last in zip(keys, transfers, timing.d2h_last_step):
        ends[key] = max(schedule.forward_last_use[key], d2h_last)
        if tr.trigger is not None:
            extra.append((tr.trigger, schedule.last_use[key], tr.nbytes))
    overlapped = (_overlapped_frees(schedule)
                  if schedule.graph.metadata.get("concurrent_ops") else {})
    buffers: dict[Any, tuple[int, int, int]] = {
        key: (start, ends.get(key, overlapped.get(key, schedule.last_use[key])),
              schedule.size[key])
        for key, start in schedule.alloc_step.items() if schedule.size[key]}
    buffers.update({("copy back", i): item for i, item in enumerate(extra) if item[2]})
    # In place: an output written into an input it is the last reader of.
    shares = [] if sharing == "none" else [
        (step, out_key, in_key) for step, out_key, in_key in schedule.inplace
        if in_key not in ends and in_key not in overlapped
        and schedule.last_use.get(in_key) == step and in_key in buffers and out_key in buffers]
    if sharing == "sharing" and allocator is not None:
        step_bytes = _allocator_bytes(schedule, buffers, shares,
                                      one_region=allocator == "bfc-one-region")
    else:
        step_bytes = _summed_bytes(schedule, buffers, shares, freed=sharing == "sharing")
    graph = schedule.graph
    persistent = graph.total_persistent_bytes
    peak_at = max(range(len(step_bytes)), key=step_bytes.__getitem__)
    base = sum(nd.forward_cost + _backward_cost(nd) for nd in graph)
    return Estimate(
        peak_bytes=step_bytes[peak_at],
        persistent_bytes=persistent,
        activation_peak_bytes=step_bytes[peak_at] - persistent,
        timeline=list(zip(schedule.labels, step_bytes)),
        peak_step=schedule.labels[peak_at],
        base_compute=base,
        extra_compute=schedule.extra_compute,
        extra_flops=schedule.extra_flops,
        sharing=sharing,
        allocator=allocator,
        host_peak_bytes=timing.host_peak_bytes,
        step_seconds=timing.makespan,
        baseline_seconds=schedule.baseline_seconds,
        stall_seconds=timing.stall_seconds,
        step_times=list(zip(timing.start, timing.end)),
    )


def _overlapped_frees(schedule: Schedule) -> dict[Key, int]:
    """The buffers freed a step later than their last reader's step when the
    device runs ready operations side by side (`"concurrent_ops"` in the
    graph's metadata, a CPU's inter-op threads): what the weights' gradient
    of a call's backward reads, when that backward is their last reader.

    Such a backward has two branches: the gradient of the call's input, which
    the next step waits for, and its weights' gradient, which only the update
    reads. The executor starts the next step on another thread while the
    weights' gradient kernel still reads the call's inputs and the gradient of
    its output (the same overlap `extract` counts for that kernel's scratch).
    Profiled on MobileNetV2 at 96 px under chen-sqrt's plan,
    `block_1_depthwise`'s padded input (14.1 MiB) and its output gradient were
    still held when `block_1_expand_BN`'s backward made its gradient, the
    measured peak. A call whose backward reads its own output (an activation
    fused into it) hands its output gradient to the activation's gradient
    first, and that one's result is what the weights' gradient reads, so its
    output gradient is freed as before. A normalization layer's weights'
    gradients are two reductions, over as much as its input's gradient reads:
    short kernels, not counted (counting them put a U-Net plan 16 MiB and a
    residual CNN's plain step 2.3 MiB further over their measured peaks).
    """
    last = len(schedule.labels) - 1
    held: dict[int, set[Any]] = {}  # backward step -> the buffers its weights' gradient reads
    for node in schedule.graph:
        if (not node.param_bytes or node.id not in schedule.backward_step
                or node.class_name.endswith("Normalization")):
            continue
        names: set[Any] = {schedule.key_of(ref)[0] for ref in node.inputs}
        outputs = {node.output_ref(k) for k in range(len(node.outputs))}
        if not outputs & set(node.backward_reads):
            # The output's gradient: its partials' sum when it has several
            # (the AddN that makes it frees them), else its one partial.
            names |= {("grad-sum", ref) if ("grad-sum", ref) in schedule.size else ("grad", ref)
                      for ref in outputs}
        held[schedule.backward_step[node.id]] = names
    return {key: min(end + 1, last) for key, end in schedule.last_use.items()
            if end in held and (key[0] in held[end] or key[:2] in held[end])}


def _summed_bytes(schedule: Schedule, buffers: dict[Any, tuple[int, int, int]],
                  shares: list[tuple[int, Any, Any]], freed: bool) -> list[int]:
    """Bytes at each step as the sum of what the buffers ask for: the persistent
    bytes, the buffers made so far (only the live ones when `freed`) and the
    workspace (every one so far when nothing is freed); an output written in
    place costs nothing beyond its input."""
    n = len(schedule.labels)
    delta = [0] * (n + 1)
    for start, last, nbytes in buffers.values():
        delta[start] += nbytes
        if freed:
            delta[min(last, n - 1) + 1] -= nbytes
    for step, out_key, in_key in shares:
        shared = min(buffers[in_key][2], buffers[out_key][2])
        delta[step] -= shared
        if freed:
            delta[step + 1] += shared
    live = schedule.graph.total_persistent_bytes
    spent_transient = 0
    out = []
    for i in range(n):
        live += delta[i]
        if freed:
            out.append(live + schedule.transient[i])
        else:
            spent_transient += schedule.transient[i]
            out.append(live + spent_transient)
    return out


def _allocator_bytes(schedule: Schedule, buffers: dict[Any, tuple[int, int, int]],
                     shares: list[tuple[int, Any, Any]], one_region: bool = False) -> list[int]:
    """Bytes at each step as TensorFlow's BFC allocator counts them.

    Buffers are freed after their last reader and their memory reused by the
    allocator's rules (`allocator.py`): each step allocates what it makes and
    frees what it read last; an output written in place takes over its input's
    chunk; a buffer held in pieces (a loop's saved per-iteration tensors) takes
    a chunk for each. The step's workspace takes chunks before the step's
    outputs and gives them back after them: a layer's intermediate tensors
    exist before its output, and where they sat decides where later buffers
    fit. Each kernel's scratch is a chunk of its own (`Schedule.scratch`), the
    rest of the workspace one more. When the extraction read the bytes the
    kernels asked for (`PlanGraph.metadata["kernel_workspaces"]["requested"]`),
    a kernel's scratch takes a chunk wherever the allocator puts it, taking a
    region when no free chunk is large enough, as TensorFlow's does: the
    regions and free chunks it leaves behind are where later requests land,
    and a chunk under twice a request is handed out whole. The rest of the
    workspace, and scratch read as the allocator's chunks, count on top when
    no free chunk fits them: the rest is many buffers, which one region would
    round up together (a `TimeDistributed` backward of 100 slice gradients, 181
    MiB, took a 256 MiB region whole: predicted 271 MiB against 190-191
    measured), and a read already counts its chunk. The persistent bytes come
    first, each layer's weights in a chunk of their own, after a region of twice the
    persistent bytes was taken and given back (a model's initializers peak near
    twice its weights: building VGG19 peaked at 402 MiB for 213 MiB of weights,
    which then sat in chunks of 218 MiB). One step is played: playing a second
    one after it, as after a warm-up step, predicted the same peaks for the
    plans of `benchmarks/rescore.py`. With `one_region` the allocator carves
    every chunk from one region holding the device's memory (a GPU without
    memory growth), so a request is handed a larger chunk only where a hole
    between chunks in use fits it best.
    """
    graph = schedule.graph
    requested = bool(graph.metadata.get("kernel_workspaces", {}).get("requested"))
    bfc = BFCAllocator(WHOLE_DEVICE_BYTES if one_region else None)
    bfc.free(bfc.allocate(2 * graph.total_persistent_bytes))
    # A shared layer's weights are on its first call only.
    weights = [node.param_bytes for node in graph if node.param_bytes]
    if sum(weights) > graph.total_persistent_bytes:  # a graph made by hand
        weights = []
    for nbytes in weights:
        bfc.allocate(nbytes)
    rest = graph.total_persistent_bytes - sum(weights)
    if rest > 0:
        bfc.allocate(rest)
    n = len(schedule.labels)
    made: list[list[Any]] = [[] for _ in range(n)]
    done: list[list[Any]] = [[] for _ in range(n)]
    for key, (start, last, _) in buffers.items():
        made[start].append(key)
        done[min(last, n - 1)].append(key)
    takes_over = {out_key: in_key for _, out_key, in_key in shares
                  if buffers[out_key][2] <= buffers[in_key][2]}
    chunks: dict[Any, list[int]] = {}
    handed_on: set[Any] = set()
    out = []
    for i in range(n):
        scratch = schedule.scratch.get(i, [])
        rest = schedule.transient[i] - sum(scratch)
        workspace, on_top = [], 0
        for nbytes, is_scratch in sorted([*((b, True) for b in scratch), (rest, False)],
                                         reverse=True):
            if 0 < nbytes and (requested and is_scratch or nbytes <= bfc.largest_free_bytes):
                workspace.append(bfc.allocate(nbytes))
            else:
                on_top += nbytes
        for key in made[i]:
            source = takes_over.get(key)
            if source in chunks and source not in handed_on:
                chunks[key] = chunks[source]
                handed_on.add(source)
            else:
                nbytes, pieces = buffers[key][2], schedule.pieces.get(key, 1)
                chunks[key] = [bfc.allocate(nbytes * (k + 1) // pieces - nbytes * k // pieces)
                               for k in range(pieces)]
        out.append(bfc.in_use_bytes + on_top)
        for address in workspace:
            bfc.free(address)
        for key in done[i]:
            if key not in handed_on:
                for address in chunks.pop(key):
                    bfc.free(address)
    return out


def _backward_cost(node: Node) -> float:
    if node.seconds_backward is not None:
        return node.seconds_backward
    return node.flops_backward
