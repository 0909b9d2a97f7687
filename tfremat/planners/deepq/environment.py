"""Episodes of the DQN agent over tfremat's simulator (the paper's environment, Sec. 4.8).

An episode walks the layer calls of one training step in execution order. At
each call where an action is valid the agent picks one of:

- nothing;
- swap-out: offload the call's outputs that the backward pass reads, each
  prefetched back on the backward step whose compute until the first reader
  covers 1.5 times the copy (the prefetch order follows reuse, Sec. 4.5);
  valid only while those outputs fit in the host memory the calls swapped out
  so far leave under the view's host budget (`GraphView.swappable`);
- remove: recompute the call in the backward pass. Consecutive removed calls
  form one recompute segment (made valid by `toolkit.valid_segments`: convex,
  shared layers whole), so a removed call's outputs are dropped and recomputed
  from the segment's inputs.

After each action that changes the plan, `tfremat.simulate` plays the whole
step (recompute segments, the two copy streams, stalls) and the reward is

    r = clip(-REWARD_SCALE * (overhead_after - overhead_before)
             + SHAPING * (excess_before - excess_after) / excess_without_plan, -1, 1)

where overhead is the simulator's extra compute plus stalls as a fraction of
the step, and excess is how far the device peak is above the budget. The
paper's reward is the negative overhead alone (Sec. 4.7); the shaping term (a
departure) rewards the memory an action takes off the peak, without which an
agent starting from random weights learns that doing nothing costs nothing.
Rewards are clipped to [-1, 1] (a departure too, for stable fitted Q-iteration
across graphs whose overheads differ by orders of magnitude). The episode ends
(terminal state) as soon as the simulated peak fits the budget, or after the last
call; ending over the budget costs `MISS_PENALTY`.

The agent's decisions do not depend on the budget (none of the six features
carries it): a budget only decides where the walk stops. So the lowest peak
along a walk is a budget the same walk meets.
"""

from __future__ import annotations

import numpy as np

from tfremat.core import Offload, Plan
from tfremat.planners import toolkit
from tfremat.planners.deepq.features import NOTHING, PREFETCH_SLACK, REMOVE, SWAP, GraphView
from tfremat.planners.swapping import offload_candidates
from tfremat.simulation import Estimate, build_schedule, simulate

#: Reward per unit of overhead (1.0 = the step takes twice as long).
REWARD_SCALE = 10.0

#: Reward for taking all of the excess over the budget off the peak.
SHAPING = 1.0

#: Reward of ending the walk over the budget.
MISS_PENALTY = -1.0


class Episode:
    """One walk through a graph's calls under a budget.

    Args:
        view: The graph's `GraphView`.
        budget_bytes: Device budget in bytes.

    Attributes:
        decisions: Action taken at each node so far.
        estimate: The simulator's estimate of the plan so far.
        lowest_peak: Lowest simulated peak along the walk.
        done: Whether the walk has ended.
    """

    def __init__(self, view: GraphView, budget_bytes: int) -> None:
        self.view = view
        self.budget_bytes = budget_bytes
        self.order = [i for i in range(view.size) if view.can_swap[i] or view.can_remove[i]]
        self.position = 0
        self.decisions = np.zeros(view.size, dtype=np.int64)
        self.plan = self._plan()
        self.estimate = self._simulate(self.plan)
        self.lowest_peak = self.estimate.peak_bytes
        self.start_excess = max(self.estimate.peak_bytes - budget_bytes, 1)
        self.done = self.estimate.peak_bytes <= budget_bytes or not self.order

    @property
    def current(self) -> int | None:
        """The node under execution, None once the walk has ended."""
        return None if self.done else self.order[self.position]

    def valid_actions(self) -> list[int]:
        """The actions valid at the node under execution."""
        c = self.current
        return [NOTHING] + ([SWAP] if self.view.swappable(self.decisions)[c] else []) + \
            ([REMOVE] if self.view.can_remove[c] else [])

    def features(self, action: int = NOTHING) -> np.ndarray:
        """Node features of the current state with `action` at the current node."""
        return self.view.features(self.decisions, self.current, action)

    def step(self, action: int) -> float:
        """Takes `action` at the node under execution and moves to the next node.

        Args:
            action: One of `valid_actions()`.

        Returns:
            The reward.
        """
        if action not in self.valid_actions():
            raise ValueError(f"Action {action} is not valid at node {self.current}.")
        reward = 0.0
        if action != NOTHING:
            self.decisions[self.current] = action
            before = self.estimate
            self.plan = self._plan()
            self.estimate = self._simulate(self.plan)
            self.lowest_peak = min(self.lowest_peak, self.estimate.peak_bytes)
            reward = (-REWARD_SCALE * (self.estimate.overhead - before.overhead)
                      + SHAPING * (self._excess(before) - self._excess(self.estimate))
                      / self.start_excess)
        self.position += 1
        fits = self.estimate.peak_bytes <= self.budget_bytes
        self.done = fits or self.position >= len(self.order)
        if self.done and not fits:
            reward += MISS_PENALTY
        return float(np.clip(reward, -1.0, 1.0))

    def _excess(self, est: Estimate) -> int:
        return max(est.peak_bytes - self.budget_bytes, 0)

    def _simulate(self, plan: Plan) -> Estimate:
        view = self.view
        return simulate(view.graph, plan, bandwidth_gbps=view.bandwidth_gbps,
                        device_flops=view.device_flops, validate=False)

    def _plan(self) -> Plan:
        """The plan of the decisions so far: segments of consecutive removed
        calls, the swapped calls' outputs offloaded. Checked by
        `Plan.validate`."""
        view, graph = self.view, self.view.graph
        runs: list[list[str]] = []
        last = -2
        for i in np.flatnonzero(self.decisions == REMOVE):
            if i != last + 1:
                runs.append([])
            runs[-1].append(graph.nodes[i].id)
            last = i
        plan = Plan.from_segments(graph, toolkit.valid_segments(graph, runs), planner="dqn")
        offloads = [o for i in np.flatnonzero(self.decisions == SWAP) for o in view.offloads[i]]
        if offloads:
            plan.offloaded = _with_triggers(view, plan, offloads)
        plan.validate(graph)
        return plan


def _with_triggers(view: GraphView, plan: Plan, offloads: list[Offload]) -> list[Offload]:
    """The offloads with triggers valid under `plan`'s segments.

    The triggers were found without segments; a segment recomputed in the
    backward pass can read a tensor earlier than its first backward reader did,
    and then the trigger must move earlier too (found again on the schedule with
    segments, the earliest option); a tensor no longer worth offloading there
    is dropped.
    """
    if not plan.segments:
        return offloads
    schedule = build_schedule(view.graph, plan, device_flops=view.device_flops)
    try:
        fine = all(schedule.backward_step[o.prefetch_after]
                   <= schedule.lifetime(schedule.key_of(o.tensor)).backward_first
                   for o in offloads)
    except (KeyError, TypeError):
        fine = False
    if fine:
        return offloads
    wanted = {o.tensor for o in offloads}
    earliest: dict[str, Offload] = {}
    for cand in offload_candidates(schedule, plan, view.min_bytes, PREFETCH_SLACK,
                                   view.bandwidth_gbps * 1e9):
        if cand.ref in wanted:
            earliest[cand.ref] = Offload(cand.ref, cand.trigger)
    return [earliest[o.tensor] for o in offloads if o.tensor in earliest]

