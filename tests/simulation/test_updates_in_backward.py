"""The simulator with optimizer updates inside the backward pass: each unit's
weight gradients are freed by its update, shared layers' at the end."""

import dataclasses

from tests.planners import graphs as G
from tfremat import simulate
from tfremat.core import Plan, Segment, with_updates_in_backward
from tfremat.planners import make_plan, min_feasible_budget
from tfremat.simulation import build_schedule

MIB = 2**20


def heavy_chain(n: int = 8, param_mib: float = 4.0, shared: bool = False):
    """A chain of dense calls whose weights (and so gradients) are large; with
    `shared`, the last call reuses the layer of the first."""
    b = G.Builder("heavy")
    x = b.input()
    for i in range(n):
        last = shared and i == n - 1
        x = b.layer("Dense", [x], cost=10.0, params=0 if last else int(param_mib * MIB),
                    layer="dense_shared" if shared and i in (0, n - 1) else None)
    return b.graph([x], persistent_mib=n * param_mib)


def test_updates_in_the_backward_pass_free_each_gradient_at_once():
    graph = heavy_chain()
    plain = simulate(graph)
    plan = Plan.from_segments(graph, [], update_in_backward=True)
    early = simulate(graph, plan)
    # Without: the weight gradients (4 MiB each) pile up until the final update.
    # With: one at a time besides the 9 activations (1 MiB each).
    assert plain.activation_peak_bytes >= 8 * 4 * MIB
    assert early.activation_peak_bytes == 9 * MIB + 4 * MIB
    schedule = build_schedule(graph, plan)
    for node in graph:
        if node.param_bytes:
            key = ("wgrad", node.id)
            assert schedule.last_use[key] == schedule.alloc_step[key]


def test_a_marked_graph_simulates_like_a_plan_with_updates():
    graph = heavy_chain()
    marked = with_updates_in_backward(graph)
    assert marked.fingerprint() == graph.fingerprint()
    assert simulate(marked).peak_bytes == simulate(
        graph, Plan.from_segments(graph, [], update_in_backward=True)).peak_bytes
    assert with_updates_in_backward(marked, False).metadata == graph.metadata


def test_a_pinned_update_runs_beside_the_next_step_where_operations_run_side_by_side():
    """Pinned, each unit's update waits for its input gradients, and so does
    the next unit's backward, not for the update: on a CPU's inter-op threads
    (profiled on VGG19) the gradient lives through the next step. Updates in
    the backward pass hold the next step back; one thread runs one at a time."""
    graph = heavy_chain()
    side_by_side = dataclasses.replace(graph, metadata={**graph.metadata,
                                                        "concurrent_ops": True})
    pinned = Plan.from_segments(graph, [], pin_order=True)
    beside = build_schedule(side_by_side, pinned)
    alone = build_schedule(graph, pinned)
    in_backward = build_schedule(side_by_side, Plan.from_segments(
        graph, [], update_in_backward=True))
    for node in graph:
        if node.param_bytes:
            key = ("wgrad", node.id)
            made = beside.alloc_step[key]
            assert beside.last_use[key] == made + 1
            assert alone.last_use[key] == alone.alloc_step[key]
            assert in_backward.last_use[key] == in_backward.alloc_step[key]
    # Two gradients (4 MiB each) at once beside the activations, not one.
    assert (simulate(side_by_side, pinned).activation_peak_bytes
            == simulate(side_by_side, Plan.from_segments(
                graph, [], update_in_backward=True)).activation_peak_bytes + 4 * MIB)


def test_a_shared_layer_is_updated_after_the_backward_pass():
    graph = heavy_chain(shared=True)
    schedule = build_schedule(graph, Plan.from_segments(graph, [], update_in_backward=True))
    key = ("wgrad", "dense_shared@0")
    assert schedule.last_use[key] == len(schedule.labels) - 1  # the final update
    own = ("wgrad", "dense_1")
    assert schedule.last_use[own] == schedule.alloc_step[own]


def test_a_segments_gradients_live_until_its_backward_ends():
    graph = heavy_chain()
    ids = [n.id for n in graph][2:5]
    plan = Plan.from_segments(graph, [Segment(ids)], update_in_backward=True)
    schedule = build_schedule(graph, plan)
    last = max(schedule.backward_step[i] for i in ids)
    for i in ids:
        assert schedule.last_use[("wgrad", i)] == last
    # The segment's own shared layer (both calls inside) is updated with it too.
    shared = heavy_chain(shared=True)
    inside = [n.id for n in shared][1:]
    schedule = build_schedule(shared, Plan.from_segments(
        shared, [Segment(inside)], update_in_backward=True))
    assert schedule.last_use[("wgrad", "dense_shared@0")] < len(schedule.labels) - 1


def test_planners_plan_against_the_lower_floor():
    graph = heavy_chain(12)
    plain_min = min_feasible_budget(graph, "chen-sqrt")
    early_min = min_feasible_budget(graph, "chen-sqrt", update_in_backward=True)
    assert early_min < plain_min - 5 * 4 * MIB
    plan = make_plan(graph, early_min, "chen-sqrt", update_in_backward=True)
    assert plan.update_in_backward
    assert plan.peak_bytes == simulate(graph, plan).peak_bytes <= early_min
    # "auto" too, offload included, and a plain plan stays plain.
    auto = make_plan(graph, early_min, update_in_backward=True)
    assert auto.update_in_backward and auto.peak_bytes <= early_min
    assert not make_plan(graph, plain_min, "chen-sqrt").update_in_backward


def test_the_flag_round_trips_and_shows_in_the_summary():
    graph = heavy_chain()
    plan = make_plan(graph, min_feasible_budget(graph, "chen-sqrt", update_in_backward=True),
                     "chen-sqrt", update_in_backward=True)
    again = Plan.from_json(plan.to_json())
    assert again.update_in_backward and again == plan
    fell_back = Plan.from_segments(graph, [], update_note="global_clipnorm needs every gradient")
    assert Plan.from_json(fell_back.to_json()).update_note == fell_back.update_note
    assert fell_back.is_empty and not Plan.from_segments(
        graph, [], update_in_backward=True).is_empty
    lines = []
    plan.summary(graph, print_fn=lines.append)
    assert "Updates:         in the backward pass" in lines[0]
    fell_back.summary(graph, print_fn=lines.append)
    assert "after the backward pass (global_clipnorm needs every gradient)" in lines[1]


def carrying_chain(carry_from: str = "dense_3"):
    """`heavy_chain(4)` on a CPU's inter-op threads, whose `dense_2` backward holds,
    besides its own 1 MiB of workspace, 16 MiB of scratch of `carry_from`'s
    weight-gradient kernel, which may still run beside it."""
    graph = heavy_chain(4, param_mib=0.5)
    nodes = [dataclasses.replace(n, backward_workspace_bytes=17 * MIB,
                                 backward_carried_bytes=16 * MIB,
                                 backward_carried_from=carry_from)
             if n.id == "dense_2" else n for n in graph]
    return dataclasses.replace(graph, nodes=nodes,
                               metadata={**graph.metadata, "concurrent_ops": True})


def step_bytes(graph, plan, label: str) -> int:
    schedule = build_schedule(graph, plan)
    return schedule.transient[schedule.labels.index(label)]


def test_a_kernel_carried_beside_a_backward_is_gone_where_units_hand_on_gradients_after_it():
    """A unit with updates in the backward pass, or pinned, hands on its input
    gradients once its weight gradients exist: its weight-gradient kernel has
    ended before the calls before it start their backward, and the scratch it
    holds (`Node.backward_carried_bytes`) is not beside theirs. Measured on a
    Sequential CNN: 137.9 MiB plain, 92.2-93.1 either way."""
    graph = carrying_chain()
    plain = Plan.from_segments(graph, [])
    assert step_bytes(graph, plain, "bwd dense_2") == 17 * MIB
    for plan in (Plan.from_segments(graph, [], update_in_backward=True),
                 Plan.from_segments(graph, [], pin_order=True)):
        assert step_bytes(graph, plan, "bwd dense_2") == MIB
        assert simulate(graph, plan).peak_bytes < simulate(graph, plain).peak_bytes
    # In one recompute segment, the unit is the segment: it waits for its
    # weight gradients only at its end, so inside it the kernel runs beside.
    together = Plan.from_segments(graph, [["dense_1", "dense_2", "dense_3"]],
                                  update_in_backward=True)
    assert step_bytes(graph, together, "bwd dense_2") == 17 * MIB
    # The call the kernel belongs to is in a segment the backward has left.
    apart = Plan.from_segments(graph, [["dense_3"]], update_in_backward=True)
    assert step_bytes(graph, apart, "bwd dense_2") == MIB


def test_a_kernel_of_a_call_on_another_branch_stays_beside_a_pinned_backward():
    """Only the calls before that unit wait for it: a call on a parallel branch
    (whose backward does not read the unit's input gradients) may run beside
    its kernel still."""
    b = G.Builder("branches")
    x = b.input()
    stem = b.layer("Dense", [x], cost=10.0, params=MIB // 2)
    left = b.layer("Dense", [stem], cost=10.0, params=MIB // 2)
    right = b.layer("Dense", [stem], cost=10.0, params=MIB // 2)
    out = b.layer("Add", [left, right], cost=1.0)
    graph = b.graph([out], persistent_mib=1.5)
    order = [n.id for n in graph]
    first, second = sorted((left, right), key=order.index, reverse=True)
    nodes = [dataclasses.replace(n, backward_workspace_bytes=17 * MIB,
                                 backward_carried_bytes=16 * MIB,
                                 backward_carried_from=first)
             if n.id in (second, stem) else n for n in graph]
    graph = dataclasses.replace(graph, nodes=nodes,
                                metadata={**graph.metadata, "concurrent_ops": True})
    pinned = Plan.from_segments(graph, [], pin_order=True)
    assert step_bytes(graph, pinned, f"bwd {second}") == 17 * MIB
    assert step_bytes(graph, pinned, f"bwd {stem}") == MIB
