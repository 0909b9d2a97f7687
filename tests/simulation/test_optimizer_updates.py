"""The simulator and what an optimizer's update holds: the buffers it makes before
any gradient exists (`PlanGraph.update_early_bytes`), and its workspace while the
backward pass goes on (`PlanGraph.update_workspace_bytes`)."""

import dataclasses

from tests.simulation.test_updates_in_backward import heavy_chain
from tfremat import PlanGraph, simulate
from tfremat.core import Plan
from tfremat.simulation import build_schedule

MIB = 2**20


def sums(graph: PlanGraph) -> PlanGraph:
    """`graph` on an allocator that counts what each buffer asks for."""
    return dataclasses.replace(graph, metadata={**graph.metadata, "allocator": None})


def test_early_buffers_live_from_the_start_until_their_gradient_is_freed():
    """SGD with momentum makes `m * momentum`, one per variable, as the step
    starts; each lives until its variable's update."""
    graph = sums(heavy_chain())  # 8 calls, 4 MiB of weights each
    early = dataclasses.replace(graph, update_early_bytes=32 * MIB)
    schedule = build_schedule(early)
    keys = [k for k in schedule.size if k[0] == "update early"]
    assert sorted(schedule.size[k] for k in keys) == [4 * MIB] * 8
    for key in keys:
        assert schedule.alloc_step[key] == 0 < schedule.loss_step
        assert schedule.last_use[key] == schedule.last_use[("wgrad", key[1])]
    # Every gradient lives to the final update here (8 calls, fewer than the
    # 24-step lifetime), so every early buffer is live at the peak.
    assert simulate(early).peak_bytes - simulate(graph).peak_bytes == 32 * MIB


def test_with_updates_in_the_backward_pass_the_early_ops_run_in_each_units_update():
    """Updates in the backward pass wait for the unit's gradients, `m * momentum`
    included: nothing is made as the step starts, and each call's 4 MiB count
    in its update, in the backward step that makes its gradient."""
    graph = sums(heavy_chain())
    early = dataclasses.replace(graph, update_early_bytes=32 * MIB)
    plan = Plan.from_segments(graph, [], update_in_backward=True)
    schedule, without = build_schedule(early, plan), build_schedule(graph, plan)
    assert not [k for k in schedule.size if k[0] == "update early"]
    for node in graph:
        if node.param_bytes:
            step = schedule.backward_step[node.id]
            assert schedule.transient[step] - without.transient[step] == 4 * MIB
    rise = simulate(early, plan).peak_bytes - simulate(graph, plan).peak_bytes
    assert 0 <= rise <= 4 * MIB


def test_a_pinned_order_keeps_the_early_ops_at_the_start():
    """Pinned without updates in the backward pass, the update after it makes
    `m * momentum` as the step starts, as a free order does."""
    graph = sums(heavy_chain())
    early = dataclasses.replace(graph, update_early_bytes=32 * MIB)
    schedule = build_schedule(early, Plan.from_segments(graph, [], pin_order=True))
    keys = [k for k in schedule.size if k[0] == "update early"]
    assert len(keys) == 8 and all(schedule.alloc_step[k] == 0 for k in keys)


def test_an_updates_workspace_counts_in_the_backward_step_that_makes_its_gradient():
    """TensorFlow starts each variable's update once its gradient exists, while
    the backward pass goes on: Adam's two variable-sized temporaries count
    there, in proportion to the call's weights."""
    graph = sums(heavy_chain())
    small = dataclasses.replace(graph, nodes=[
        dataclasses.replace(n, param_bytes=n.param_bytes // 2) if n.id == "dense_3" else n
        for n in graph.nodes])
    with_ws = dataclasses.replace(small, update_workspace_bytes=8 * MIB)
    plain, busy = build_schedule(small), build_schedule(with_ws)
    for node in small:
        if not node.param_bytes:
            continue
        step = busy.backward_step[node.id]
        extra = busy.transient[step] - plain.transient[step]
        assert extra == 8 * MIB * node.param_bytes // (4 * MIB), node.id
    final = len(busy.labels) - 1
    assert busy.transient[final] - plain.transient[final] == 8 * MIB


def test_the_early_bytes_round_trip_through_json():
    graph = dataclasses.replace(heavy_chain(), update_early_bytes=12345)
    assert PlanGraph.from_json(graph.to_json()).update_early_bytes == 12345
