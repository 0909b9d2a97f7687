"""Time model of one training step: compute on the device, two copy streams beside it.

Each step of the schedule computes for `node_seconds` of its call: the measured
time when the graph has one, else its FLOPs divided by the device's FLOP rate
(`DEVICE_FLOPS`, 5e12 FLOP/s by default: a mid-range GPU's sustained rate; the
FLOPs-based step time is only as right as that rate). The loss and the
optimizer update count 0.

Host offload uses two copy streams that run beside compute, as a GPU's copy
engines do: device-to-host (D2H) and host-to-device (H2D). Each stream moves
one tensor at a time, in the order the copies were issued, at `bandwidth` bytes
per second. For an offloaded tensor:

- the D2H copy is issued when the step producing the tensor ends (vDNN, the DQN
  paper: copy while the forward readers still read it);
- the H2D copy is issued when the prefetch trigger step is dispatched (when the
  step before it ends), and cannot start before the D2H copy has completed;
- a step reading a tensor still on its way back waits for it: the wait is a
  stall added to the step time.

Compute never waits for a D2H copy: it only keeps the device buffer alive until
the copy completes (the simulator counts it).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Sequence

from tfremat.core import Node

#: Default device FLOP rate (FLOP/s) for calls without measured times.
DEVICE_FLOPS = 5e12

#: Default bandwidth of each copy stream, in GB/s (1e9 bytes per second).
BANDWIDTH_GBPS = 16.0


def node_seconds(node: Node, device_flops: float = DEVICE_FLOPS) -> tuple[float, float]:
    """Forward and backward compute time of one call.

    Args:
        node: The call.
        device_flops: FLOP/s of the device, used where no time was measured.

    Returns:
        `(forward seconds, backward seconds)`: the measured times when present,
        else FLOPs over `device_flops`.
    """
    forward = node.seconds_forward
    if forward is None:
        forward = node.flops_forward / device_flops
    backward = node.seconds_backward
    if backward is None:
        backward = node.flops_backward / device_flops
    return forward, backward


@dataclasses.dataclass(frozen=True)
class Transfer:
    """The copies of one offloaded tensor, in steps of the schedule.

    Attributes:
        nbytes: Bytes copied each way.
        produced: Step making the tensor; the D2H copy is issued when it ends.
        trigger: Step whose dispatch issues the H2D copy, or None when the
            tensor never comes back (no backward reader).
        first_reader: First step reading the copy back, or None.
    """

    nbytes: int
    produced: int
    trigger: int | None
    first_reader: int | None


@dataclasses.dataclass
class Timing:
    """When each step runs and where the copies land.

    Attributes:
        start: Start of each step's compute, stalls included.
        end: End of each step's compute.
        stall_seconds: Total time compute waited for H2D copies.
        makespan: End of the last step or copy, whichever is later.
        d2h_last_step: For each transfer, the last step that starts before its
            D2H copy completes: its device buffer is alive until then.
        host_peak_bytes: Largest sum of host copies alive at once; a host copy
            lives from its D2H issue until its H2D copy (or, with no copy back,
            its D2H copy) completes.
    """

    start: list[float]
    end: list[float]
    stall_seconds: float
    makespan: float
    d2h_last_step: list[int]
    host_peak_bytes: int


def run_timeline(seconds: Sequence[float], transfers: Sequence[Transfer],
                 bandwidth: float) -> Timing:
    """Plays the schedule's compute and the transfers' copies in time.

    Args:
        seconds: Compute time of each step.
        transfers: The offloaded tensors' copies.
        bandwidth: Bytes per second of each copy stream.

    Returns:
        The `Timing`.
    """
    n = len(seconds)
    issued_at: dict[int, list[int]] = {}
    read_at: dict[int, list[int]] = {}
    made_at: dict[int, list[int]] = {}
    for i, tr in enumerate(transfers):
        made_at.setdefault(tr.produced, []).append(i)
        if tr.trigger is not None:
            issued_at.setdefault(tr.trigger, []).append(i)
            read_at.setdefault(tr.first_reader, []).append(i)
    d2h_done = [0.0] * len(transfers)
    h2d_done = [0.0] * len(transfers)
    d2h_free = h2d_free = 0.0
    start, end = [0.0] * n, [0.0] * n
    stall = 0.0
    clock = 0.0
    for j in range(n):
        if j in issued_at:
            for i in sorted(issued_at[j], key=lambda i: (transfers[i].first_reader, i)):
                begin = max(h2d_free, clock, d2h_done[i])
                h2d_free = h2d_done[i] = begin + transfers[i].nbytes / bandwidth
        if j in read_at:
            ready = max(h2d_done[i] for i in read_at[j])
            if ready > clock:
                stall += ready - clock
                clock = ready
        start[j] = clock
        clock += seconds[j]
        end[j] = clock
        for i in made_at.get(j, ()):
            begin = max(d2h_free, clock)
            d2h_free = d2h_done[i] = begin + transfers[i].nbytes / bandwidth
    d2h_last = [bisect.bisect_left(start, d2h_done[i]) - 1 for i in range(len(transfers))]
    host_events = []
    for i, tr in enumerate(transfers):
        gone = h2d_done[i] if tr.trigger is not None else d2h_done[i]
        host_events += [(end[tr.produced], 1, tr.nbytes), (gone, 0, -tr.nbytes)]
    # At equal times an allocation counts before a release (the larger figure).
    host_events.sort(key=lambda e: (e[0], -e[1]))
    host = host_peak = 0
    for _, _, nbytes in host_events:
        host += nbytes
        host_peak = max(host_peak, host)
    makespan = max([clock, *d2h_done, *h2d_done])
    return Timing(start, end, stall, makespan, d2h_last, host_peak)
