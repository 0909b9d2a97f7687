"""Exact DP over all lower sets (Kusumoto et al. Sec. 4.2), pure Python bitsets.

States are triplets (L, objective, m) with m = M(U); per lower set only the
Pareto front of (objective, m) is kept (the sparse table of the paper with its
pruning). The number of lower sets is exponential in the graph's width, so a
deadline bounds the work: past it `DPTimeout` is raised.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

from tfremat.planners._dp_model import DPModel, DPResult

SOLVER_OBJECTIVES = ("time", "memory", "peak")


#: Enumerating more lower sets than this is given up (memory), as a timeout.
MAX_LOWER_SETS = 1_000_000


class DPTimeout(TimeoutError):
    """The exact DP cannot finish: past its time limit, or too many lower sets.

    Attributes:
        time_limit: The limit in seconds.
        lower_sets: Lower sets enumerated before stopping (None if unknown).
    """

    def __init__(self, time_limit: float | None, lower_sets: int | None = None) -> None:
        self.time_limit = time_limit
        self.lower_sets = lower_sets
        if lower_sets is not None and lower_sets > MAX_LOWER_SETS:
            why = f"the graph has more than {MAX_LOWER_SETS:,} lower sets"
        else:
            counted = f" ({lower_sets:,} lower sets)" if lower_sets is not None else ""
            why = f"it did not finish within {time_limit:g} s{counted}"
        super().__init__(f"The exact DP gave up: {why}. Use planner='approx-dp' or "
                         "raise time_limit.")


class Deadline:
    """Raises `DPTimeout` once `time_limit` seconds (None: no limit) have passed
    since creation, or when more than `MAX_LOWER_SETS` lower sets are counted."""

    def __init__(self, time_limit: float | None) -> None:
        self.time_limit = time_limit
        self.end = math.inf if time_limit is None else time.monotonic() + time_limit

    def check(self, lower_sets: int | None = None) -> None:
        if time.monotonic() > self.end or (lower_sets or 0) > MAX_LOWER_SETS:
            raise DPTimeout(self.time_limit, lower_sets)


def lower_sets(model: DPModel, deadline: Deadline) -> list[int]:
    """All lower sets of the model's graph, by increasing size.

    Args:
        model: The DP model.
        deadline: Checked while the enumeration grows.

    Returns:
        Bitsets, the empty set first and V last.

    Raises:
        DPTimeout: the deadline passed or there are more than `MAX_LOWER_SETS`.
    """
    sets = [0]
    for v in range(model.n):
        bit, need = 1 << v, model.pred[v]
        sets += [s | bit for s in sets if not need & ~s]
        deadline.check(len(sets))
    sets.sort(key=int.bit_count)
    return sets


class ExactDP:
    """The exact DP over the lower sets of one model, reusable across budgets.

    The states of a lower set are numpy arrays; the terms of each step between
    two lower sets (`DPModel.step`) are worked out once and reused by every solve.

    Args:
        model: The DP model.
        deadline: Checked while enumerating and solving.
        track: Called as `track(description, total)` before each solve; returns
            a callable advanced with the number of lower sets processed.

    Raises:
        DPTimeout: the deadline passed while enumerating the lower sets.
    """

    def __init__(self, model: DPModel, deadline: Deadline,
                 track: Callable[[str, int], Callable[[int], None]] | None = None) -> None:
        self.model = model
        self.deadline = deadline
        self.track = track
        self.sets = lower_sets(model, deadline)
        self.bnd = {s: model.boundary(s) for s in self.sets}
        self.outer = {s: model.outer_bytes(s) for s in self.sets}
        self.index = {s: i for i, s in enumerate(self.sets)}
        self._steps: list[tuple[list[int], np.ndarray, np.ndarray, np.ndarray]] | None = None

    def steps(self) -> list[tuple[list[int], np.ndarray, np.ndarray, np.ndarray]]:
        """Per lower set (by index): its strict supersets and the Eq. (1)/(2)
        terms of each step to them (peak part, cost, bytes cached)."""
        if self._steps is None:
            model, sets = self.model, self.sets
            by_size: list[list[int]] = [[] for _ in range(model.n + 1)]
            for s in sets:
                by_size[s.bit_count()].append(s)
            steps = []
            for lower in sets:
                uppers = [u for bigger in by_size[lower.bit_count() + 1:] for u in bigger
                          if u & lower == lower]
                terms = np.array([model.step(lower, u, self.bnd[u], self.outer[u])
                                  for u in uppers], dtype=np.float64).reshape(-1, 3)
                steps.append(([self.index[u] for u in uppers], terms[:, 0], terms[:, 1],
                              terms[:, 2]))
                self.deadline.check(len(sets))
            self._steps = steps
        return self._steps

    def solve(self, budget: float, objective: str) -> DPResult | None:
        """Runs the DP.

        Args:
            budget: Bound on every M(i) (persistent bytes included);
                `math.inf` for none.
            objective: `"time"`: least overhead; `"memory"`: most overhead
                (the memory-centric strategy); `"peak"`: least peak, budget
                ignored.

        Returns:
            The best sequence, or None when no sequence meets the budget.

        Raises:
            DPTimeout: the deadline passed.
        """
        if objective not in SOLVER_OBJECTIVES:
            raise ValueError(f"Unknown objective {objective!r}; choose one of {SOLVER_OBJECTIVES}.")
        steps = self.steps()
        advance = (self.track(f"exact DP ({objective})", len(self.sets))
                   if self.track else None)
        by_peak = objective == "peak"
        sign = -1.0 if objective == "memory" else 1.0
        # Columns of a state: objective, m, overhead, Eq. (2) peak, parent set,
        # parent state (its row in the parent's front).
        pending: list[list[np.ndarray]] = [[] for _ in self.sets]
        pending[0].append(np.zeros((1, 6)))
        pending[0][0][0, 4:] = -1
        fronts: list[np.ndarray] = []
        for i, (targets, part, cost, cache) in enumerate(steps):
            front = _pareto(np.concatenate(pending[i])) if pending[i] else np.zeros((0, 6))
            pending[i] = []
            fronts.append(front)
            if front.size and targets:
                here = front[:, 1:2] + part[None, :]
                rows, cols = (np.nonzero(np.ones_like(here, dtype=bool)) if by_peak
                              else np.nonzero(here <= budget))
                peak = np.maximum(front[rows, 3], here[rows, cols])
                new = np.column_stack([
                    peak if by_peak else front[rows, 0] + sign * cost[cols],
                    front[rows, 1] + cache[cols], front[rows, 2] + cost[cols], peak,
                    np.full(rows.size, i, dtype=np.float64), rows.astype(np.float64)])
                order = np.argsort(cols, kind="stable")
                cols, new = cols[order], new[order]
                bounds = np.flatnonzero(np.diff(cols)) + 1
                for chunk_cols, chunk in zip(np.split(cols, bounds), np.split(new, bounds)):
                    if chunk.size:
                        pending[targets[chunk_cols[0]]].append(chunk)
            self.deadline.check(len(self.sets))
            if advance:
                advance(1)
        final = fronts[-1]
        if not final.size:
            return None
        best, state = final[0], (len(self.sets) - 1, 0)
        sequence = []
        while state[0] > 0:
            sequence.append(self.sets[state[0]])
            row = fronts[state[0]][state[1]]
            state = (int(row[4]), int(row[5]))
        return DPResult(sequence[::-1], overhead=float(best[2]), peak=int(best[3]))


def _pareto(states: np.ndarray) -> np.ndarray:
    """States not dominated in (objective, m), best objective first."""
    states = states[np.lexsort((states[:, 1], states[:, 0]))]
    lowest_before = np.minimum.accumulate(np.concatenate([[np.inf], states[:-1, 1]]))
    return states[states[:, 1] < lowest_before]
