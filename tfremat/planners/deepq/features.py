"""What the DQN sees of a PlanGraph: six features per node and weighted edges.

The DQN paper (Sec. 4.4.1) describes each node by six features: the size of
its variable, the time to transfer it between device and host, the time to
recompute it, how soon it is used again, the action type of the node and
whether that action is valid. Here a node is a layer call of the PlanGraph,
visited in execution (topological) order, and its variable is what the call
keeps for the backward pass. Every feature is scaled to [0, 1] so that graphs of
different sizes and costs look alike to the network:

0. size: activation bytes over the mean of the graph's non-input calls, as
   `x / (1 + x)`;
1. transfer time: the copy of the outputs the backward pass reads, over the
   mean compute time of a step, as `x / (1 + x)`;
2. recompute time: the call's forward time over the mean compute time of a
   step, as `x / (1 + x)`;
3. how soon used again: steps from the call to the first backward read of its
   outputs, over the length of the step's schedule (0 when never read again);
4. action type: 0 nothing (or not decided yet), 0.5 swap-out, 1 remove
   (recompute);
5. valid: 1 when an action can still be taken at the node: it can be
   removed, or its outputs can be swapped out and still fit in the host
   memory left under the host budget (what the calls swapped out so far hold
   at once: every offloaded tensor is on the host at the turn from forward to
   backward, so their sum is the simulator's host peak, or above it).

Edges (Sec. 4.2): consecutive calls and producer-consumer pairs, both ways,
plus a self-loop on every node (N(v) contains v), weighted by the time lag
between the two calls' forward steps over the mean step time, as `x / (1 + x)`.

`FEATURES_VERSION` names this definition; the shipped weights record the
version they were trained for, and loading refuses any other.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfremat.core import Offload, Plan, PlanGraph
from tfremat.planners import toolkit
from tfremat.planners.swapping import MIN_BYTES, offload_candidates
from tfremat.simulation import BANDWIDTH_GBPS, DEVICE_FLOPS, build_schedule

#: Version of the features below; bump it whenever their definition changes.
FEATURES_VERSION = 1

#: Features per node.
NUM_FEATURES = 6

#: The actions, in the order of their index.
ACTIONS = ("nothing", "swap", "remove")
NOTHING, SWAP, REMOVE = range(3)

#: Value of feature 4 (action type) for each action.
ACTION_CODES = np.array([0.0, 0.5, 1.0], dtype=np.float32)

#: The prefetch trigger a swap-out uses covers this many times the copy with
#: compute (the earliest of the swap planner's trigger options).
PREFETCH_SLACK = 1.5


def _squash(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + x)


@dataclasses.dataclass
class GraphView:
    """The static facts the agent uses about one PlanGraph.

    Attributes:
        graph: The PlanGraph.
        static: `(n, 4)` features 0-3 of every node (zeros for InputLayers).
        can_swap: `(n,)` whether a node's outputs can be offloaded.
        can_remove: `(n,)` whether a node can be recomputed.
        offloads: For each node that can be swapped, the Offloads of its
            outputs with their prefetch triggers (found without segments).
        swap_bytes: `(n,)` bytes a swap-out of each node puts on the host.
        src: Source node of each edge, edges sorted by destination.
        dst: Destination node of each edge (sorted).
        weight: Weight of each edge.
        dst_starts: First edge of each node in `dst` order.
        src_order: Edge indices sorted by source.
        src_starts: First position of each node in `src_order`.
        bandwidth_gbps: Copy bandwidth the features were computed for.
        device_flops: Device rate the features were computed for.
        min_bytes: Smallest tensor offered for offload.
        host_budget_bytes: Host memory the swapped-out outputs may hold at
            once (None: no limit).
    """

    graph: PlanGraph
    static: np.ndarray
    can_swap: np.ndarray
    can_remove: np.ndarray
    offloads: dict[int, list[Offload]]
    swap_bytes: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    weight: np.ndarray
    dst_starts: np.ndarray
    src_order: np.ndarray
    src_starts: np.ndarray
    bandwidth_gbps: float
    device_flops: float
    min_bytes: int
    host_budget_bytes: int | None = None

    @property
    def size(self) -> int:
        return len(self.graph)

    def swappable(self, decisions: np.ndarray) -> np.ndarray:
        """`(n,)` whether each node's outputs can be swapped out after
        `decisions`: offload candidates whose bytes fit in the host memory left."""
        if self.host_budget_bytes is None:
            return self.can_swap
        left = self.host_budget_bytes - int(self.swap_bytes[decisions == SWAP].sum())
        return self.can_swap & (self.swap_bytes <= left)

    def features(self, decisions: np.ndarray, current: int | None,
                 action: int = NOTHING) -> np.ndarray:
        """The `(n, 6)` feature matrix of a state of the episode.

        Args:
            decisions: Action taken at each node so far (`NOTHING` for nodes
                not reached yet).
            current: The node under execution (None once the episode is over).
            action: The action considered at `current`: its type (feature 4)
                is written there, the way the paper's action nodes carry it.

        Returns:
            float32 features, one row per node.
        """
        x = np.empty((self.size, NUM_FEATURES), dtype=np.float32)
        x[:, :4] = self.static
        x[:, 4] = ACTION_CODES[decisions]
        actionable = self.swappable(decisions) | self.can_remove
        later = np.zeros(self.size, dtype=bool)
        if current is not None:
            later[current:] = True
            x[current, 4] = ACTION_CODES[action]
        x[:, 5] = actionable & later
        return x


def describe(graph: PlanGraph, *, bandwidth_gbps: float = BANDWIDTH_GBPS,
             device_flops: float = DEVICE_FLOPS, min_bytes: int = MIN_BYTES,
             host_budget_bytes: int | None = None) -> GraphView:
    """Computes the static features, the valid actions and the edges of `graph`.

    Args:
        graph: The PlanGraph.
        bandwidth_gbps: Bandwidth of each copy stream in GB/s.
        device_flops: FLOP/s of the device, for calls without measured times.
        min_bytes: Smallest tensor offered for offload.
        host_budget_bytes: Host memory the swapped-out outputs may hold at
            once (None: no limit).

    Returns:
        The `GraphView`.
    """
    n = len(graph)
    schedule = build_schedule(graph, device_flops=device_flops)
    forward_step = {label[4:]: i for i, label in enumerate(schedule.labels)
                    if label.startswith("fwd ")}
    seconds = np.asarray(schedule.seconds, dtype=np.float64)
    mean_seconds = float(seconds[seconds > 0].mean()) if np.any(seconds > 0) else 1.0
    starts = np.concatenate([[0.0], np.cumsum(seconds)[:-1]])
    lifetimes = schedule.lifetimes()
    bandwidth = bandwidth_gbps * 1e9
    sizes = np.array([toolkit.activation_bytes(nd) for nd in graph], dtype=np.float64)
    real = np.array([not nd.is_input for nd in graph])
    mean_size = float(sizes[real].mean()) if real.any() and sizes[real].mean() > 0 else 1.0
    static = np.zeros((n, 4), dtype=np.float32)
    for i, node in enumerate(graph):
        if node.is_input:
            continue
        kept = [lifetimes[node.output_ref(k)] for k in range(len(node.outputs))
                if node.output_ref(k) in lifetimes]
        reused = [life for life in kept if life.backward_first is not None]
        step = forward_step[node.id]
        static[i, 0] = _squash(sizes[i] / mean_size)
        copy = sum(life.nbytes for life in reused) / bandwidth
        static[i, 1] = _squash(copy / mean_seconds)
        static[i, 2] = _squash(seconds[step] / mean_seconds)
        if reused:
            first = min(life.backward_first for life in reused)
            static[i, 3] = (first - step) / len(schedule.labels)
    base = Plan.from_segments(graph, [], planner="none")
    offloads: dict[int, list[Offload]] = {}
    tensor_bytes: dict[str, int] = {}
    for cand in offload_candidates(schedule, base, min_bytes, PREFETCH_SLACK, bandwidth):
        node = graph.index(cand.ref.rsplit(":", 1)[0])
        chosen = offloads.setdefault(node, [])
        # Options come latest trigger first: the last one seen is the earliest.
        chosen[:] = [o for o in chosen if o.tensor != cand.ref]
        chosen.append(Offload(cand.ref, cand.trigger))
        tensor_bytes[cand.ref] = cand.nbytes
    can_swap = np.zeros(n, dtype=bool)
    can_swap[list(offloads)] = True
    swap_bytes = np.zeros(n, dtype=np.int64)
    for node, chosen in offloads.items():
        swap_bytes[node] = sum(tensor_bytes[o.tensor] for o in chosen)
    can_remove = real & (sizes > 0)
    pairs = {(i, i) for i in range(n)}
    pairs |= {(i, i + 1) for i in range(n - 1)} | {(i + 1, i) for i in range(n - 1)}
    for j, node in enumerate(graph):
        for p in graph.predecessors(node.id):
            i = graph.index(p)
            pairs |= {(i, j), (j, i)}
    src, dst = (np.array(a, dtype=np.int64) for a in zip(*sorted(pairs, key=lambda e: e[::-1])))
    at = np.array([starts[forward_step[nd.id]] if nd.id in forward_step else 0.0
                   for nd in graph])
    weight = _squash(np.abs(at[src] - at[dst]) / mean_seconds).astype(np.float32)
    src_order = np.argsort(src, kind="stable")
    return GraphView(
        graph=graph, static=static, can_swap=can_swap, can_remove=can_remove,
        offloads=offloads, swap_bytes=swap_bytes, src=src, dst=dst, weight=weight,
        dst_starts=np.searchsorted(dst, np.arange(n)),
        src_order=src_order, src_starts=np.searchsorted(src[src_order], np.arange(n)),
        bandwidth_gbps=bandwidth_gbps, device_flops=device_flops, min_bytes=min_bytes,
        host_budget_bytes=host_budget_bytes)
