"""The swap planner and offload in "auto": plans valid, within budget in the
simulator, host budget honoured, and lower budgets than recomputation alone."""

import pytest

from tfremat.core import BudgetError
from tfremat.planners.chen import chen_sqrt
from tfremat.planners.dp import approx_dp
from tfremat.planners.registry import make_plan, min_feasible_budget
from tfremat.planners.swapping import default_host_budget, swap, swap_combined
from tfremat.simulation import build_schedule, simulate

from tests.planners import graphs as G

MIB = 2**20

#: The synthetic graphs' costs are tens of FLOPs: at 1e5 FLOP/s a Dense call's
#: forward takes 0.1 ms, while a 1 MiB copy at 16 GB/s takes 0.066 ms.
TIMING = {"device_flops": 1e5}

GRAPHS = {
    "chain": lambda: G.chain(30),
    "resnet": lambda: G.resnet_like(4),
    "unet": lambda: G.unet_like(3),
}


def lowest(graph, **settings) -> int:
    with pytest.raises(BudgetError) as info:
        swap(graph, 0, **TIMING, **settings)
    return info.value.min_budget_bytes


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("fraction", [0.8, 0.6])
def test_swap_plans_are_valid_and_fit_in_the_simulator(name, fraction):
    graph = GRAPHS[name]()
    budget = int(simulate(graph, **TIMING).peak_bytes * fraction)
    plan = swap(graph, budget, **TIMING)
    plan.validate(graph)
    assert plan.planner == "swap" and plan.offloaded and not plan.segments
    est = simulate(graph, plan, **TIMING)
    assert plan.peak_bytes == est.peak_bytes <= budget
    assert plan.estimates.host_peak_bytes == est.host_peak_bytes > 0
    assert plan.estimates.overhead == est.overhead


def test_hidden_copies_cost_no_time():
    graph = G.chain(30)
    plan = swap(graph, int(simulate(graph, **TIMING).peak_bytes * 0.8), **TIMING)
    assert plan.estimates.stall_seconds == 0
    assert plan.estimates.step_seconds == pytest.approx(plan.estimates.baseline_seconds)


def test_prefetch_triggers_come_before_the_first_reader_and_skip_the_last_layers():
    graph = G.chain(30)
    minimum = lowest(graph)
    plan = swap(graph, minimum, **TIMING)
    schedule = build_schedule(graph, plan)
    first_backward = schedule.loss_step + 1
    for off in plan.offloaded:
        life = schedule.lifetime(schedule.key_of(off.tensor))
        assert schedule.backward_step[off.prefetch_after] < life.backward_first
        # A tensor read by the first backward step has nothing to hide behind.
        assert life.backward_first > first_backward


def test_tiny_tensors_are_not_offloaded():
    graph = G.chain(30)  # every tensor is 1 MiB
    with pytest.raises(BudgetError) as info:
        swap(graph, 0, min_bytes=MIB + 1, **TIMING)
    assert info.value.min_budget_mb * MIB == simulate(graph, **TIMING).peak_bytes


def test_budget_error_carries_a_tight_minimum():
    graph = G.resnet_like(4)
    minimum = lowest(graph)
    assert minimum < simulate(graph, **TIMING).peak_bytes
    assert swap(graph, minimum, **TIMING).peak_bytes <= minimum
    with pytest.raises(BudgetError, match="'swap'"):
        swap(graph, minimum - 1, **TIMING)


def test_host_budget_is_honoured():
    graph = G.chain(30)
    free = lowest(graph)
    host = 3 * MIB
    capped = lowest(graph, host_budget_bytes=host)
    assert capped > free
    plan = swap(graph, capped, host_budget_bytes=host, **TIMING)
    assert plan.estimates.host_peak_bytes <= host
    assert plan.settings["host_budget_bytes"] == host


def test_default_host_budget_is_half_the_free_memory():
    import os

    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < default_host_budget() <= 0.5 * free * 1.05
    assert default_host_budget(0.25) < default_host_budget(0.75)


def test_swap_on_a_recompute_plan_keeps_its_segments_and_goes_lower():
    graph = G.chain(30)
    base = chen_sqrt(graph)
    # A tensor's worth below the recompute plan (weight gradients alive in
    # between keep the floor a few KiB above two tensors' worth).
    budget = base.peak_bytes - MIB
    plan = swap(graph, budget, base_plan=base, **TIMING)
    assert plan.segments == base.segments and plan.offloaded
    assert plan.settings["base_planner"] == "chen-sqrt"
    assert simulate(graph, plan, **TIMING).peak_bytes <= budget


def test_combined_offloads_instead_of_recomputing_where_cheaper():
    graph = G.chain(30)
    budget = int(simulate(graph, **TIMING).peak_bytes * 0.7)
    recompute = approx_dp(graph, budget)
    assert recompute.estimates.overhead > 0
    plan = swap_combined(graph, budget, [recompute], **TIMING)
    assert plan.estimates.overhead < recompute.estimates.overhead
    assert plan.peak_bytes <= budget


def saved_chain(n: int, saved_mib: float):
    """A chain whose calls keep internal tensors: recomputable, not offloadable.

    Its device counts the bytes each buffer asks for (`metadata["allocator"]`
    None): in TensorFlow's BFC allocator the 1-2 MiB buffers of this chain sit
    in regions of 2-16 MiB whose chunks, not what is offloaded, set the floor
    (offload and recomputation together met the recompute-only minimum, 13.0
    MiB, and went below it only at 20 calls of 4 MiB out of 15 shapes tried).
    """
    b = G.Builder("saved-chain")
    x = b.input()
    for _ in range(n):
        x = b.layer("Dense", [x], cost=10.0, params=1024, saved_mib=saved_mib)
    graph = b.graph([x])
    graph.metadata["allocator"] = None
    return graph


def test_auto_with_offload_goes_below_the_recompute_minimum():
    # Internal tensors of 2 MiB per call: recomputing them back is what limits
    # recompute-only plans, and offloading outputs takes the rest. (With 40
    # calls, the last call's backward is the floor of both.)
    graph = saved_chain(20, 2.0)
    recompute_min = min_feasible_budget(graph, offload=False)
    combined_min = min_feasible_budget(graph, **TIMING)
    # Neither recomputation nor offload alone gets there.
    assert combined_min < recompute_min and combined_min < lowest(graph)
    plan = make_plan(graph, combined_min, **TIMING)
    plan.validate(graph)
    assert plan.planner == "swap" and plan.offloaded and plan.segments
    assert simulate(graph, plan, **TIMING).peak_bytes <= combined_min
    assert "offloading" in plan.estimates.note
    with pytest.raises(BudgetError, match="offloading on top of them: "):
        make_plan(graph, combined_min - 1, **TIMING)


def test_auto_without_offload_keeps_recompute_only_behaviour():
    graph = G.unet_like(3)
    recompute_min = min_feasible_budget(graph, offload=False)
    with pytest.raises(BudgetError) as info:
        make_plan(graph, recompute_min - 2 * MIB, offload=False)
    assert info.value.min_budget_bytes == recompute_min
    assert "swap" not in str(info.value)
    # Where recomputation fits, offload changes nothing.
    budget = (recompute_min + simulate(graph).peak_bytes) // 2
    with_offload = make_plan(graph, budget)
    assert not with_offload.offloaded
    assert with_offload.segments == make_plan(graph, budget, offload=False).segments
