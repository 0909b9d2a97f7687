"""The cost model of Kusumoto et al. 2019 over a PlanGraph, with bitset lower sets.

V is the set of non-input calls, numbered 0..n-1 in topological order; a node
set is a Python int whose bit v stands for node v. For a sequence of lower sets
L_1 < ... < L_k = V with blocks V_i = L_i \\ L_{i-1} and cache
U_i = boundary(L_1) | ... | boundary(L_i), the peak while back-propagating
V_i is Eq. (2) plus the step's persistent bytes:

    M(i) = M(U_{i-1}) + 2 M(V_i) + M(d+(L_i) \\ L_i) + M(d-(d+(L_i)) \\ L_i) + W(V_i)

with M_v the call's output bytes plus its internal saved bytes. W(V_i) goes
beyond the paper, whose memory holds activations only: it is the bytes of
weight gradients alive when the backward pass enters V_i (at its last node in
topological order), as the simulator keeps them (the last
`GRADIENT_LIFETIME_STEPS` gradients made; all of them under a multi-replica
strategy, `gradient_lifetime`). Near the output of a ResNet they
reach 57 MiB (ResNet50 at batch 16), and without them the DP spreads its
budget evenly while the simulator's peak sits at the last stage. Eq. (1)
is adapted to how tfremat recomputes (one recompute segment per block):
a block that drops anything re-runs all its calls, so it costs T(V_i), where
T_v is `Node.forward_cost`; a block whose calls are all cached costs nothing, and
the last block is not recomputed (its backward follows its forward at once).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tfremat.core import PlanGraph, split_ref
from tfremat.planners.toolkit import activation_bytes
from tfremat.simulation import gradient_lifetime, requires_grad


class BitSum:
    """Sums of per-node weights over bitsets, by 8-bit lookup tables."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.tables = []
        for start in range(0, len(weights), 8):
            chunk = weights[start:start + 8]
            table = [0] * 256
            for byte in range(1, 256):
                low = (byte & -byte).bit_length() - 1
                table[byte] = table[byte & (byte - 1)] + (chunk[low] if low < len(chunk) else 0)
            self.tables.append(table)

    def __call__(self, mask: int) -> float:
        total = 0
        for table in self.tables:
            if not mask:
                break
            total += table[mask & 255]
            mask >>= 8
        return total


@dataclasses.dataclass
class DPModel:
    """Eq. (1) and (2) of Kusumoto et al. for one PlanGraph.

    Attributes:
        ids: Ids of the non-input nodes, bit v standing for `ids[v]`.
        mem: M_v in bytes.
        cost: T_v (`Node.forward_cost`).
        succ: Bitset of each node's successors in V.
        pred: Bitset of each node's predecessors in V.
        sinks: Bitset of the nodes whose outputs the loss reads.
        persistent: Persistent bytes of the step, added to every M(i).
        wgrad: W at each node: weight-gradient bytes alive when the backward
            pass reaches it.
    """

    ids: list[str]
    mem: list[int]
    cost: list[float]
    succ: list[int]
    pred: list[int]
    sinks: int
    persistent: int
    wgrad: list[int]

    def __post_init__(self) -> None:
        self.n = len(self.ids)
        self.full = (1 << self.n) - 1
        self.msum = BitSum(self.mem)
        self.tsum = BitSum(self.cost)

    @classmethod
    def of(cls, graph: PlanGraph) -> "DPModel":
        """Builds the model of `graph` (InputLayers left out, as in the paper)."""
        nodes = [n for n in graph if not n.is_input]
        bit = {n.id: v for v, n in enumerate(nodes)}
        succ = [0] * len(nodes)
        pred = [0] * len(nodes)
        for v, node in enumerate(nodes):
            for p in graph.predecessors(node.id):
                if p in bit:
                    pred[v] |= 1 << bit[p]
                    succ[bit[p]] |= 1 << v
        sinks = 0
        for ref in graph.outputs:
            node_id = split_ref(ref)[0]
            if node_id in bit:
                sinks |= 1 << bit[node_id]
        return cls(ids=[n.id for n in nodes], mem=[activation_bytes(n) for n in nodes],
                   cost=[n.forward_cost for n in nodes], succ=succ, pred=pred,
                   sinks=sinks, persistent=graph.total_persistent_bytes,
                   wgrad=weight_gradients_alive(graph, [n.id for n in nodes]))

    # -- sets ----------------------------------------------------------------------

    def members(self, mask: int) -> list[int]:
        """Bits set in `mask`, ascending."""
        bits = bin(mask)[:1:-1]
        return [v for v, c in enumerate(bits) if c == "1"]

    def closure(self) -> list[int]:
        """L_v for each v: v and all its ancestors (the approximate DP's keys)."""
        anc = [0] * self.n
        for v in range(self.n):
            acc = 1 << v
            for p in self.members(self.pred[v]):
                acc |= anc[p]
            anc[v] = acc
        return anc

    def boundary(self, lower: int) -> int:
        """The nodes of `lower` read from outside it (or by the loss, until L = V)."""
        out = 0
        outside = self.full & ~lower
        for v in self.members(lower):
            if self.succ[v] & outside:
                out |= 1 << v
        if lower != self.full:
            out |= lower & self.sinks
        return out

    def outer_bytes(self, lower: int) -> int:
        """M(d+(L) \\ L) + M(d-(d+(L)) \\ L), the last two terms of Eq. (2)."""
        plus = 0
        for v in self.members(lower):
            plus |= self.succ[v]
        plus &= ~lower
        minus = 0
        for w in self.members(plus):
            minus |= self.pred[w]
        return self.msum(plus) + self.msum(minus & ~lower)

    def step(self, lower: int, upper: int, bnd_upper: int, outer_upper: int
             ) -> tuple[int, float, int]:
        """One block V = upper \\ lower: (peak terms but M(U), cost, bytes cached).

        Args:
            lower: L_{i-1}.
            upper: L_i, a strict superset of `lower`.
            bnd_upper: `boundary(upper)`.
            outer_upper: `outer_bytes(upper)`.

        Returns:
            `(2 M(V) + outer + persistent + W(V), cost of V,
            M(boundary(upper) & V))`;
            M(i) is `M(U_{i-1})` plus the first item.
        """
        block = upper & ~lower
        peak = (2 * self.msum(block) + outer_upper + self.persistent
                + self.wgrad[block.bit_length() - 1])
        dropped = block & ~bnd_upper
        cost = self.tsum(block) if dropped and upper != self.full else 0.0
        return peak, cost, self.msum(bnd_upper & block)

    def evaluate(self, sequence: Sequence[int]) -> tuple[float, int]:
        """Overhead and Eq. (2) peak of a lower-set sequence ending at V."""
        cached, total, peak, prev = 0, 0.0, 0, 0
        for lower in sequence:
            bnd = self.boundary(lower)
            part, cost, cache = self.step(prev, lower, bnd, self.outer_bytes(lower))
            peak = max(peak, cached + part)
            total += cost
            cached += cache
            prev = lower
        return total, peak

    def blocks(self, sequence: Sequence[int]) -> list[tuple[list[str], bool]]:
        """Node ids of each block and whether it is recomputed (drops anything)."""
        out, prev = [], 0
        for lower in sequence:
            block = lower & ~prev
            recompute = lower != self.full and bool(block & ~self.boundary(lower))
            out.append(([self.ids[v] for v in self.members(block)], recompute))
            prev = lower
        return out


def weight_gradients_alive(graph: PlanGraph, ids: list[str]) -> list[int]:
    """W for each of `ids`: bytes of the weight gradients alive at its backward step.

    Mirrors the simulator without recomputation: calls are back-propagated in
    reverse order, and each keeps the gradients of the last
    `gradient_lifetime(graph)` calls with weights (all of them when None),
    plus those it releases.
    """
    needs_grad = requires_grad(graph)
    lifetime = gradient_lifetime(graph)
    alive: list[int] = []
    at: dict[str, int] = {}
    for node in reversed(graph.nodes):
        if not needs_grad[node.id]:
            continue
        released = 0
        while lifetime is not None and len(alive) >= lifetime:
            released += alive.pop(0)
        if node.param_bytes:
            alive.append(node.param_bytes)
        at[node.id] = sum(alive) + released
    return [at.get(i, 0) for i in ids]


@dataclasses.dataclass
class DPResult:
    """A lower-set sequence found by a DP, with its model overhead and peak."""

    sequence: list[int]
    overhead: float
    peak: int
