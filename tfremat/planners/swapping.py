"""Host offload: copy activations to host memory and prefetch them back in time.

`swap` adds offloaded tensors to a recompute plan (or to no plan) until the
simulated device peak meets the budget. A candidate is a tensor the forward
pass makes and the backward pass reads (a recompute segment's input included:
its recomputation reads it), of at least `min_bytes`, with at least one
backward step before its first backward reader to prefetch behind (the last
layers, whose backward follows their forward at once, have none). Its prefetch
trigger is the backward step k steps before that reader; the options for k are
the nearest steps whose compute until the reader covers `prefetch_slack`, 1
and 1/2 times the copy, and k = 1 (least device memory, most stall).

The choice is greedy, judged by the simulator (the DQN paper's environment):
at each round, the moves that can take a tensor off the device at the current
peak step (offload it, or prefetch an offloaded one later) are ranked by
guessed stall and size, simulated, and the one with the most bytes saved at the
peak per second of added step time is taken; a host peak above the host budget
rules a move out. `swap_combined` runs `swap` on top of several recompute plans
and keeps the cheapest plan that fits: recompute first and offload the
remaining overflow, or offload instead where that is cheaper.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from tfremat.core import MIB, BudgetError, Offload, Plan, PlanGraph
from tfremat.planners import toolkit as seg
from tfremat.simulation import (BANDWIDTH_GBPS, DEVICE_FLOPS, Estimate, Schedule,
                              build_schedule, simulate)

#: Tensors smaller than this are not offloaded by default (copy latency, host
#: bookkeeping and the small saving make them not worth it).
MIN_BYTES = 2**20

#: When the best move found stalls, up to this many times `trials` moves are
#: simulated looking for one that does not.
STALL_SEARCH = 4

#: Share of the host's free memory the default host budget allows.
HOST_FRACTION = 0.5


def default_host_budget(fraction: float = HOST_FRACTION) -> int:
    """A share of the host memory free now.

    Args:
        fraction: Share of the free physical memory to allow.

    Returns:
        `fraction` times the free physical memory, in bytes
        (`os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')`).
    """
    return int(fraction * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One tensor with one prefetch trigger (steps of the schedule it was found on).

    Attributes:
        ref: The tensor, `"node_id:index"`.
        nbytes: Its size.
        produced: Step making it.
        first_reader: Its first backward reader's step.
        trigger: Node whose backward step issues the copy back.
        trigger_step: That step.
    """

    ref: str
    nbytes: int
    produced: int
    first_reader: int
    trigger: str
    trigger_step: int

    @property
    def offload(self) -> Offload:
        return Offload(self.ref, self.trigger)


def swap(graph: PlanGraph, budget_bytes: int, *, base_plan: Plan | None = None,
         bandwidth_gbps: float = BANDWIDTH_GBPS, device_flops: float = DEVICE_FLOPS,
         host_budget_bytes: int | None = None, min_bytes: int = MIN_BYTES,
         prefetch_slack: float = 1.5, trials: int = 8) -> Plan:
    """Offloads activations to host memory until the device budget is met.

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes, persistent bytes included.
        base_plan: A plan for `graph` to offload on top of (its segments and
            offloaded tensors are kept); None starts from no plan.
        bandwidth_gbps: Bandwidth of each copy stream in GB/s.
        device_flops: FLOP/s of the device, for calls without measured times.
        host_budget_bytes: Host memory the offloaded tensors may hold at once;
            None allows `default_host_budget()`.
        min_bytes: Smallest tensor to offload.
        prefetch_slack: The earliest prefetch trigger tried is the nearest
            backward step whose compute until the first reader covers this many
            times the copy.
        trials: Moves simulated per round before the best is taken (more are
            tried when none of them lowers the peak without a stall).

    Returns:
        A Plan with the base plan's segments and the offloaded tensors, whose
        `PlanEstimate` (overhead with stalls, host peak, step, baseline and
        stall seconds) comes from `simulate` with the same bandwidth and
        device rate.

    Raises:
        BudgetError: the greedy search ends above the budget; the minimum is the
            lowest simulated peak it reached.
    """
    base = base_plan if base_plan is not None else Plan.from_segments(graph, [],
                                                                      planner="none")
    base.validate(graph)
    host_budget = default_host_budget() if host_budget_bytes is None else host_budget_bytes
    settings = {"bandwidth_gbps": bandwidth_gbps, "device_flops": device_flops,
                "host_budget_bytes": host_budget, "min_bytes": min_bytes,
                "prefetch_slack": prefetch_slack, "trials": trials,
                "base_planner": base.planner}
    chosen: dict[str, Candidate] = {}

    def offloads(move: Candidate | None = None) -> list[Offload]:
        picked = chosen if move is None else {**chosen, move.ref: move}
        return list(base.offloaded) + [c.offload for c in picked.values()]

    def evaluate(move: Candidate | None = None) -> Estimate:
        plan = dataclasses.replace(base, offloaded=offloads(move))
        return simulate(graph, plan, bandwidth_gbps=bandwidth_gbps, device_flops=device_flops,
                        validate=False)

    schedule = build_schedule(graph, base, device_flops=device_flops)
    bandwidth = bandwidth_gbps * 1e9
    options = offload_candidates(schedule, base, min_bytes, prefetch_slack, bandwidth)
    est = evaluate()
    while est.peak_bytes > budget_bytes:
        peak_at = max(range(len(est.timeline)), key=lambda i: (est.timeline[i][1], -i))
        # Offload a tensor, or prefetch one later, so it is off the device at the peak.
        moves = [c for c in options if c.produced < peak_at < c.trigger_step
                 and (c.ref not in chosen or chosen[c.ref].trigger_step <= peak_at)]
        pick = _best_move(est, peak_at, moves, evaluate, host_budget, bandwidth, trials)
        if pick is None:
            break
        move, est, ruled_out = pick
        chosen[move.ref] = move
        options = [c for c in options if c not in ruled_out and c != move]
    if est.peak_bytes > budget_bytes:
        raise BudgetError(
            budget_bytes, est.peak_bytes, "swap",
            f"Offloading {len(chosen)} tensors (host peak "
            f"{est.host_peak_bytes / MIB:.1f} MiB of {host_budget / MIB:.1f} "
            f"allowed, {bandwidth_gbps:g} GB/s) on top of {base.planner!r} left no "
            "candidate that lowers the peak.")
    plan = Plan(graph_fingerprint=graph.fingerprint(), budget_bytes=budget_bytes,
                planner="swap", settings=settings, segments=list(base.segments),
                offloaded=offloads(), estimates=est.plan_estimate(with_time=True),
                update_in_backward=base.update_in_backward, pin_order=base.pin_order,
                node_ids=[n.id for n in graph])
    plan.validate(graph)
    return plan


def swap_combined(graph: PlanGraph, budget_bytes: int, bases: Sequence[Plan],
                  **settings: Any) -> Plan:
    """Offloads on top of each recompute plan and keeps the cheapest that fits.

    No plan (offload only) is always tried too, so offloading wins where it is
    cheaper than recomputing, and recomputation plus offload reaches budgets
    neither reaches alone.

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes.
        bases: Recompute plans for `graph` (e.g. a recompute planner's plans at
            several budgets).
        **settings: Settings of `swap`.

    Returns:
        The least-overhead plan within budget (then the lowest peak).

    Raises:
        BudgetError: no base leads to a plan within budget; the minimum is the
            lowest simulated peak reached on any of them.
    """
    plans, lowest, tried = [], None, []
    for base in [Plan.from_segments(graph, [], planner="none"), *bases]:
        try:
            plans.append(swap(graph, budget_bytes, base_plan=base, **settings))
        except BudgetError as err:
            reached = err.min_budget_bytes
            lowest = reached if lowest is None else min(lowest, reached)
            tried.append(f"on {base.planner!r} ({len(base.segments)} segments): "
                         f"{err.feasible_mb:.1f} MiB")
    if plans:
        return min(plans, key=seg.cost)
    raise BudgetError(budget_bytes, lowest, "swap",
                      "Offloading meets at least: " + "; ".join(tried) + ".")


# -- helpers ---------------------------------------------------------------------


def offload_candidates(schedule: Schedule, base: Plan, min_bytes: int, slack: float,
                       bandwidth: float) -> list[Candidate]:
    """Every tensor worth offloading, each with its prefetch trigger options.

    The options are the nearest backward steps whose compute until the first
    reader covers `slack`, 1 and 1/2 times the copy, and the step just before
    the reader; the earliest step after the loss when none covers enough. As
    the rewriter needs (`tfremat.core.validate_plan`), a trigger comes after
    every forward reader of its tensor, model outputs stay on the device, and
    a tensor read inside the segment making it is not a candidate.

    Args:
        schedule: The schedule of the step under `base`'s segments.
        base: The plan offloading would be added to (its offloaded tensors are
            left out).
        min_bytes: Smallest tensor to consider.
        slack: The earliest trigger tried covers this many times the copy.
        bandwidth: Bytes per second of each copy stream.

    Returns:
        One `Candidate` per tensor and trigger option, latest trigger first.
    """
    graph = schedule.graph
    taken = {schedule.key_of(o.tensor)[0] for o in base.offloaded}
    node_at = {step: nid for nid, step in schedule.backward_step.items()
               if any(graph.tensor(r).differentiable for r in graph.node(nid).inputs)}
    consumers = graph.consumers()
    segment_of = {n: k for k, seg_ in enumerate(base.segments) for n in seg_.nodes}
    out = []
    for ref, life in schedule.lifetimes().items():
        first = life.backward_first
        if first is None or life.nbytes < min_bytes or ref in taken or ref in graph.outputs:
            continue
        producer = segment_of.get(ref.rsplit(":", 1)[0])
        readers = consumers[ref]
        if not readers or (producer is not None and any(
                segment_of.get(r) == producer for r in readers)):
            continue
        last_reader = max(graph.index(r) for r in readers)
        steps = [s for s in range(first - 1, schedule.loss_step, -1)
                 if s in node_at and graph.index(node_at[s]) > last_reader]
        if not steps:  # nothing to prefetch behind: the last layers
            continue
        copy = life.nbytes / bandwidth
        triggers = {steps[0]} | {_covering(schedule, steps, first, need)
                                 for need in (0.5 * copy, copy, slack * copy)}
        for step in sorted(triggers, reverse=True):
            out.append(Candidate(ref, life.nbytes, life.produced, first, node_at[step], step))
    return out


def _covering(schedule: Schedule, steps: list[int], first: int, need: float) -> int:
    """The latest of `steps` (backward steps, latest first) whose compute until
    step `first` lasts `need` seconds, else the earliest of them."""
    covered, s = 0.0, first
    for step in steps:
        covered += sum(schedule.seconds[step:s])
        s = step
        if covered >= need:
            return step
    return steps[-1]


def _best_move(est: Estimate, peak_at: int, moves: list[Candidate],
               evaluate: Callable[[Candidate], Estimate], host_budget: int,
               bandwidth: float, trials: int
               ) -> tuple[Candidate, Estimate, set[Candidate]] | None:
    """Simulates moves, best guesses first, `trials` at a time until one helps.

    Returns:
        The move with the most bytes saved at the peak per second of added step
        time, its estimate, and the moves ruled out for good because they break
        the host budget (the host peak only grows as tensors are added); None
        when no move lowers the peak (or, on a tie, the old peak step).
    """
    starts = [s for s, _ in est.step_times]
    ends = [e for _, e in est.step_times]

    def guess(c: Candidate) -> tuple:
        copy = c.nbytes / bandwidth
        gone_in_time = ends[c.produced] + copy <= starts[peak_at]
        stall = max(0.0, copy - (starts[c.first_reader] - starts[c.trigger_step]))
        return (not gone_in_time, stall, -c.nbytes)

    moves = sorted(moves, key=guess)
    eps = 1e-6 * (est.baseline_seconds or 1.0)
    ruled_out: set[Candidate] = set()
    best, best_score, best_added = None, (False, 0.0), 0.0
    for lo in range(0, len(moves), trials):
        for c in moves[lo:lo + trials]:
            trial = evaluate(c)
            if trial.host_peak_bytes > host_budget:
                ruled_out.add(c)
                continue
            if trial.peak_bytes > est.peak_bytes:
                continue
            lowered = trial.peak_bytes < est.peak_bytes
            # When the peak only moves to a tie, credit what left the old peak step.
            gain = (est.peak_bytes - trial.peak_bytes if lowered else
                    est.timeline[peak_at][1] - trial.timeline[peak_at][1])
            added = max(trial.step_seconds - est.step_seconds, 0.0)
            score = (lowered, gain / (added + eps))
            if gain > 0 and score > best_score:
                best, best_score, best_added = (c, trial), score, added
        # A move that costs no time cannot be beaten by much; a stalling one
        # is worth a few more rounds of trials.
        if best is not None and (best_added == 0 or lo + trials >= STALL_SEARCH * trials):
            break
    return None if best is None else (best[0], best[1], ruled_out)
