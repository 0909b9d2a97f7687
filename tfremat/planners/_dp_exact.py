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

from tfremat.planners._dp_model import DPModel, DPResult

OBJECTIVES = ("time", "memory", "peak")


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
        self.by_size: list[list[int]] = [[] for _ in range(model.n + 1)]
        for s in self.sets:
            self.by_size[s.bit_count()].append(s)

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
        if objective not in OBJECTIVES:
            raise ValueError(f"Unknown objective {objective!r}; choose one of {OBJECTIVES}.")
        model, by_size = self.model, self.by_size
        advance = (self.track(f"exact DP ({objective})", len(self.sets))
                   if self.track else None)
        by_peak = objective == "peak"
        sign = -1.0 if objective == "memory" else 1.0
        # A state: (objective, m, t, eq2 peak, lower set, previous state).
        pending: dict[int, list[tuple]] = {0: [(0.0, 0, 0.0, 0, 0, None)]}
        final: list[tuple] = []
        for size, group in enumerate(by_size):
            for lower in group:
                front = _pareto(pending.pop(lower, []))
                if lower == model.full:
                    final = front
                    continue
                for bigger in by_size[size + 1:]:
                    for upper in bigger:
                        if upper & lower != lower:
                            continue
                        part, cost, cache = model.step(lower, upper, self.bnd[upper],
                                                       self.outer[upper])
                        into = pending.setdefault(upper, [])
                        for state in front:
                            obj, m, t, peak = state[:4]
                            here = m + part
                            if here > budget and not by_peak:
                                continue
                            new_peak = max(peak, here)
                            new_obj = new_peak if by_peak else obj + sign * cost
                            into.append((new_obj, m + cache, t + cost, new_peak, upper,
                                         state))
                self.deadline.check(len(self.sets))
            if advance:
                advance(len(group))
        if not final:
            return None
        best = state = final[0]
        sequence = []
        while state is not None and state[4]:
            sequence.append(state[4])
            state = state[5]
        return DPResult(sequence[::-1], overhead=best[2], peak=best[3])


def _pareto(states: list[tuple]) -> list[tuple]:
    """States not dominated in (objective, m), best objective first."""
    states.sort(key=lambda s: (s[0], s[1]))
    front, lowest = [], math.inf
    for state in states:
        if state[1] < lowest:
            front.append(state)
            lowest = state[1]
    return front
