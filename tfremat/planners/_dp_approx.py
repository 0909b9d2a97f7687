"""Approximate DP over ancestor closures (Kusumoto et al. Sec. 4.3), with numpy.

The keys are the lower sets L_v = {v and its ancestors} (plus the empty set and
V), so at most |V| + 2 keys. Every quantity of a step L_i -> L_j is precomputed
for all key pairs at once with 0/1 matrix products, and the DP keeps, per key,
the best state in each of `buckets` bands of the cached bytes m = M(U): the
objective is exact for the states it keeps, m is carried exactly (never
rounded), so every sequence it returns meets the budget under Eq. (2).
"""

from __future__ import annotations

import math

import numpy as np

from tfremat.planners._dp_exact import SOLVER_OBJECTIVES
from tfremat.planners._dp_model import DPModel, DPResult


class PairTables:
    """Eq. (1)/(2) terms of every step from a key to a bigger key, as arrays.

    Attributes:
        keys: Lower sets by increasing size, the empty set first and V last.
        targets: For each key i, the indices j of its strict supersets.
        peak: For each key i, `2 M(V) + outer + persistent + W(V)` of each
            step i -> j.
        cost: For each key i, the recompute cost of each step.
        cache: For each key i, the bytes each step adds to the cache U.
    """

    def __init__(self, model: DPModel) -> None:
        keys = sorted({0, model.full, *model.closure()}, key=int.bit_count)
        n = model.n
        lower = _bits(keys, n)
        succ = _bits(model.succ, n)
        mem = np.asarray(model.mem, dtype=np.float64)
        cost = np.asarray(model.cost, dtype=np.float64)
        outside = 1.0 - lower
        bnd = lower * ((outside @ succ.T) > 0)
        not_full = np.array([k != model.full for k in keys])
        bnd = np.maximum(bnd, lower * _bits([model.sinks], n) * not_full[:, None])
        plus = ((lower @ succ) > 0) * outside
        minus = ((plus @ succ.T) > 0) * outside
        outer = plus @ mem + minus @ mem

        size = lower.sum(axis=1)
        sub = ((lower @ outside.T) == 0) & (size[:, None] < size[None, :])
        mem_l, cost_l, mem_b = lower @ mem, lower @ cost, bnd @ mem
        # [i, j]: totals over L_i & boundary(L_j), L_i being inside L_j.
        shared_mem = (lower * mem) @ bnd.T
        shared_count = lower @ bnd.T
        block_count = size[None, :] - size[:, None]
        kept_count = bnd.sum(axis=1)[None, :] - shared_count
        drops = (block_count > kept_count) & not_full[None, :]

        # W is read at the block's last node: v for a key L_v, and for the key V
        # the last node outside L_i.
        wgrad = np.asarray(model.wgrad, dtype=np.float64)
        last = np.array([k.bit_length() - 1 for k in keys])
        last_outside = np.array([(model.full & ~k).bit_length() - 1 for k in keys])
        block_w = np.where(np.arange(len(keys))[None, :] == len(keys) - 1,
                           wgrad[last_outside][:, None], wgrad[last][None, :])
        peak = (2 * (mem_l[None, :] - mem_l[:, None]) + outer[None, :] + model.persistent
                + block_w)
        step_cost = np.where(drops, cost_l[None, :] - cost_l[:, None], 0.0)
        cache = mem_b[None, :] - shared_mem
        self.keys = keys
        self.targets = [np.flatnonzero(row) for row in sub]
        self.peak = [peak[i, t] for i, t in enumerate(self.targets)]
        self.cost = [step_cost[i, t] for i, t in enumerate(self.targets)]
        self.cache = [cache[i, t] for i, t in enumerate(self.targets)]
        self.max_cache = float(mem_l[-1])


def solve(model: DPModel, tables: PairTables, budget: float, objective: str,
          buckets: int = 64) -> DPResult | None:
    """Runs the approximate DP.

    Args:
        model: The DP model.
        tables: `PairTables(model)`, reusable across budgets and objectives.
        budget: Bound on every M(i) (persistent bytes included); `math.inf`
            for none.
        objective: `"time"`, `"memory"` or `"peak"` as in the exact DP.
        buckets: Bands of cached bytes kept per key.

    Returns:
        The best sequence found, or None when none meets the budget.
    """
    if objective not in SOLVER_OBJECTIVES:
        raise ValueError(f"Unknown objective {objective!r}; choose one of {SOLVER_OBJECTIVES}.")
    k = len(tables.keys)
    span = budget - model.persistent if math.isfinite(budget) else tables.max_cache
    width = max(span, 1.0) / buckets
    obj = np.full((k, buckets), np.inf)
    cached = np.zeros((k, buckets))
    parent = np.full((k, buckets, 2), -1, dtype=np.int64)
    obj[0, 0] = 0.0
    sign = -1.0 if objective == "memory" else 1.0
    for i in range(k - 1):
        slots = np.flatnonzero(obj[i] < np.inf)
        targets = tables.targets[i]
        if not slots.size or not targets.size:
            continue
        slots = _pareto(slots, obj[i, slots], cached[i, slots])
        o, m = obj[i, slots], cached[i, slots]
        here = m[:, None] + tables.peak[i][None, :]
        if objective == "peak":
            s_idx, t_idx = np.divmod(np.arange(here.size), targets.size)
            new_obj = np.maximum(o[s_idx], here.ravel())
        else:
            s_idx, t_idx = np.nonzero(here <= budget)
            new_obj = o[s_idx] + sign * tables.cost[i][t_idx]
        if not s_idx.size:
            continue
        new_m = m[s_idx] + tables.cache[i][t_idx]
        dest = targets[t_idx]
        band = np.minimum((new_m / width).astype(np.int64), buckets - 1)
        held = obj[dest, band]
        gain = (new_obj < held) | ((new_obj == held) & (new_m < cached[dest, band]))
        if not gain.any():
            continue
        s_idx, new_obj, new_m, dest, band = (
            s_idx[gain], new_obj[gain], new_m[gain], dest[gain], band[gain])
        flat = dest * buckets + band
        order = np.lexsort((new_m, new_obj, flat))
        flat_sorted = flat[order]
        keep = np.empty(order.size, dtype=bool)
        keep[0] = True
        np.not_equal(flat_sorted[1:], flat_sorted[:-1], out=keep[1:])
        first = order[keep]
        d, b = dest[first], band[first]
        obj[d, b] = new_obj[first]
        cached[d, b] = new_m[first]
        parent[d, b, 0] = i
        parent[d, b, 1] = slots[s_idx[first]]
    last = k - 1
    if not obj[last].min() < np.inf:
        return None
    slot = int(np.argmin(obj[last]))
    path = [last]
    while path[-1] > 0:
        key, slot = parent[path[-1], slot]
        path.append(int(key))
    path.reverse()
    overhead, peak, m = 0.0, 0.0, 0.0
    for i, j in zip(path, path[1:]):
        pos = int(np.searchsorted(tables.targets[i], j))
        peak = max(peak, m + tables.peak[i][pos])
        overhead += tables.cost[i][pos]
        m += tables.cache[i][pos]
    return DPResult([tables.keys[j] for j in path[1:]], overhead=float(overhead),
                    peak=int(peak))


def _bits(masks: list[int], n: int) -> np.ndarray:
    """0/1 float matrix with one row per bitset and one column per node."""
    width = max((n + 7) // 8, 1)
    raw = b"".join(m.to_bytes(width, "little") for m in masks)
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(len(masks), width)
    return np.unpackbits(arr, axis=1, bitorder="little")[:, :n].astype(np.float64)


def _pareto(slots: np.ndarray, obj: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """Slots not dominated in (objective, cached bytes)."""
    order = np.lexsort((obj, cached))
    ranked = obj[order]
    best_before = np.empty_like(ranked)
    best_before[0] = np.inf
    np.minimum.accumulate(ranked[:-1], out=best_before[1:])
    return slots[order[ranked < best_before]]
