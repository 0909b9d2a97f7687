"""`dqn`: swap and recompute planned by the DQN paper's agent, checked by the simulator."""

from __future__ import annotations

import dataclasses
import numbers
import os

import numpy as np

from tfremat.core import BudgetError, Plan, PlanGraph, warn
from tfremat.planners.deepq import network
from tfremat.planners.deepq.agent import Agent
from tfremat.planners.deepq.features import ACTIONS, FEATURES_VERSION, GraphView, describe
from tfremat.planners.swapping import MIN_BYTES, default_host_budget
from tfremat.simulation import BANDWIDTH_GBPS, DEVICE_FLOPS, simulate

#: The weights trained by `python -m tfremat.planners.deepq.train --seed 0`.
SHIPPED_WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights.npz")


def dqn(graph: PlanGraph, budget_bytes: int, *, finetune_episodes: int = 0, seed: int = 0,
        weights: str | os.PathLike | None = None, bandwidth_gbps: float = BANDWIDTH_GBPS,
        device_flops: float = DEVICE_FLOPS, min_bytes: int = MIN_BYTES,
        host_budget_bytes: int | None = None, offload: bool = True,
        finetune_time_limit: float | None = None) -> Plan:
    """Plans host offload and recomputation with the DQN paper's agent.

    The agent walks the layer calls in execution order and, at each, swaps
    its outputs out to the host, removes it (recomputes it in the backward
    pass) or does nothing, taking the action of highest Q value (Eq. 3) until
    the simulated peak fits the budget. With `finetune_episodes`, it first
    trains on this graph and budget (Algorithm 1, starting from the weights),
    as the paper fine-tunes on large graphs; `finetune_time_limit` bounds that
    training, after which the agent as trained so far plans. The result is an
    ordinary Plan:
    consecutive removed calls become recompute segments, swapped outputs become
    offloaded tensors with their prefetch triggers, and `tfremat.simulate`
    gives its estimates.

    When the agent's plan misses the budget, `dqn` warns and returns planner
    `"auto"`'s plan instead (its `estimates.details["fallback"]` says so, and
    `"agent_peak_bytes"` and `"agent_overhead"` give the agent's own plan's
    figures): it never returns a plan over the budget.

    Swap-out is a valid action only while the outputs swapped out so far and
    the call's own fit in `host_budget_bytes` (the paper's "valid action"
    feature), so the plan's simulated host peak stays within the host budget,
    as the `swap` planner's does; the fallback gets the same host budget.

    With `offload=False` the agent only removes or leaves calls (swap-out is
    never a valid action, as at nodes the swap planner offers no tensor of)
    and the fallback is `"auto"` without offload: a recompute-only plan, the
    kind whose peak can be measured on a CPU.

    Args:
        graph: The PlanGraph.
        budget_bytes: Device budget in bytes, persistent bytes included.
        finetune_episodes: Episodes of training on this graph before planning
            (0: the shipped weights as they are).
        finetune_time_limit: Seconds fine-tuning may take (None: no limit).
            It is checked before each episode: once it has passed, no further
            episode starts, `dqn` warns, and the agent as fine-tuned so far
            plans; `estimates.details["finetune_episodes_run"]` says how many
            episodes ran. A limit makes the plan depend on the machine's speed.
        seed: Seed of fine-tuning's exploration and replay.
        weights: A `.npz` written by `tfremat.planners.deepq.train` (default:
            the shipped weights).
        bandwidth_gbps: Bandwidth of each copy stream in GB/s.
        device_flops: FLOP/s of the device, for calls without measured times.
        min_bytes: Smallest tensor the agent may offload.
        host_budget_bytes: Host memory the offloaded tensors may hold at once;
            None allows `default_host_budget()` (half the free host memory),
            as for `swap`.
        offload: Whether the agent may swap outputs out to the host (and the
            fallback may offload); False gives recompute-only plans.

    Returns:
        A Plan within the budget whose `PlanEstimate` comes from `simulate`
        (with step, baseline and stall seconds).

    Raises:
        ValueError: a bad setting, or weights trained for other features.
        BudgetError: neither the agent nor `"auto"` meets the budget; the
            minimum is the lower of the lowest peak along the agent's walk and
            `"auto"`'s minimum.

    Example:

    >>> plan = tfremat.plan(model, budget_mb=2000, planner="dqn", finetune_episodes=20,
    ...                     finetune_time_limit=300, host_budget_bytes=8 * 2**30)
    >>> plan.estimates.details["actions"]
    """
    if isinstance(finetune_episodes, bool) or not isinstance(
            finetune_episodes, numbers.Integral) or finetune_episodes < 0:
        raise ValueError(f"finetune_episodes must be a non-negative integer, got "
                         f"{finetune_episodes!r}.")
    if finetune_time_limit is not None and (
            isinstance(finetune_time_limit, bool)
            or not isinstance(finetune_time_limit, numbers.Real) or finetune_time_limit < 0):
        raise ValueError(f"finetune_time_limit must be None or a non-negative number of "
                         f"seconds, got {finetune_time_limit!r}.")
    if bandwidth_gbps <= 0 or device_flops <= 0:
        raise ValueError(f"bandwidth_gbps and device_flops must be positive, got "
                         f"{bandwidth_gbps!r} and {device_flops!r}.")
    settings = {"finetune_episodes": int(finetune_episodes), "seed": seed,
                "bandwidth_gbps": bandwidth_gbps, "device_flops": device_flops,
                "min_bytes": min_bytes}
    if finetune_time_limit is not None:
        settings["finetune_time_limit"] = finetune_time_limit
    if offload:
        settings["host_budget_bytes"] = (default_host_budget() if host_budget_bytes is None
                                         else host_budget_bytes)
    else:
        settings["offload"] = False
    if weights is not None:
        settings["weights"] = os.fspath(weights)
    timing = {"bandwidth_gbps": bandwidth_gbps, "device_flops": device_flops}
    params, _ = network.load_weights(SHIPPED_WEIGHTS if weights is None else weights)
    plain = simulate(graph, **timing)
    if plain.peak_bytes <= budget_bytes:
        return Plan.from_segments(
            graph, [], planner="dqn", budget_bytes=budget_bytes, settings=settings,
            estimates=plain.plan_estimate(with_time=True, note="The step fits the budget "
                                          "without a plan: no rewrite needed."))
    view = describe(graph, min_bytes=min_bytes,
                    host_budget_bytes=settings.get("host_budget_bytes"), **timing)
    if not offload:  # no swap-out anywhere: the agent removes or does nothing
        view = dataclasses.replace(view, can_swap=np.zeros_like(view.can_swap), offloads={})
    agent = Agent(params, seed=seed)
    details: dict = {}
    stopped = ""
    if finetune_episodes:
        run = _finetune(agent, view, budget_bytes, int(finetune_episodes),
                        finetune_time_limit)
        details["finetune_episodes_run"] = run
        if run < finetune_episodes:
            stopped = (f"Fine-tuning stopped at its time limit of {finetune_time_limit:g} s "
                       f"after {run} of {finetune_episodes} episodes")
            warn(f"{stopped}: the agent as fine-tuned so far plans.")
            stopped += ". "
    episode = agent.greedy(view, budget_bytes)
    counts = {name: int(np.sum(episode.decisions == k)) for k, name in enumerate(ACTIONS)
              if k}
    details.update({"actions": counts, "features_version": FEATURES_VERSION,
                    "agent_peak_bytes": episode.estimate.peak_bytes,
                    "agent_overhead": episode.estimate.overhead})
    if episode.estimate.peak_bytes <= budget_bytes:
        plan = episode.plan
        plan.budget_bytes = budget_bytes
        plan.settings = settings
        plan.estimates = episode.estimate.plan_estimate(
            with_time=True, details=details,
            note=f"{stopped}The DQN agent swapped {counts['swap']} and removed "
                 f"{counts['remove']} calls' outputs; simulated peak "
                 f"{episode.estimate.peak_mb:.1f} MiB.")
        plan.validate(graph)
        return plan
    return _fallback(graph, budget_bytes, settings, episode.lowest_peak, details, stopped)


def _finetune(agent: Agent, view: GraphView, budget_bytes: int, episodes: int,
              time_limit: float | None) -> int:
    """Trains `agent` on the graph and budget; how many episodes ran before
    `time_limit` seconds passed (all of them without a limit)."""
    ran: list[int] = []
    agent.train([(view, budget_bytes)], episodes, time_limit=time_limit,
                on_episode=lambda k, episode, losses: ran.append(k))
    return len(ran)


def _fallback(graph: PlanGraph, budget_bytes: int, settings: dict, lowest_peak: int,
              details: dict, stopped: str = "") -> Plan:
    """Planner "auto"'s plan, labelled as the DQN's fallback, with a warning."""
    from tfremat.planners.registry import SWAP_SETTINGS, make_plan

    missed = (f"The DQN agent's plan reached {lowest_peak / 2**20:.1f} MiB at best, over "
              f"the budget of {budget_bytes / 2**20:.1f} MiB")
    try:
        plan = make_plan(graph, budget_bytes, "auto", offload=settings.get("offload", True),
                         **{k: v for k, v in settings.items() if k in SWAP_SETTINGS})
    except BudgetError as err:
        raise BudgetError(budget_bytes, min(lowest_peak, err.min_budget_bytes), "dqn",
                          f"{missed}; planner 'auto' reached "
                          f"{err.feasible_mb:.1f} MiB.") from None
    warn(f"{missed}: using the plan of planner 'auto' instead.")
    plan.planner = "dqn"
    plan.settings = {**settings, "fallback": "auto"}
    plan.estimates = simulate(graph, plan, bandwidth_gbps=settings["bandwidth_gbps"],
                              device_flops=settings["device_flops"]).plan_estimate(
        with_time=True, details={**details, "fallback": "auto"},
        note=f"{stopped}{missed}; this is the plan of planner 'auto' ({plan.estimates.note})")
    return plan
