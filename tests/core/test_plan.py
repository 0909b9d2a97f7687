"""The Plan: typed estimates, JSON round trips, plans written by tfremat 0.1, errors."""

import dataclasses
import json
import pathlib

import pytest

from tests.planners import graphs as G
from tfremat import simulate
from tfremat.core import (BudgetError, Plan, PlanEstimate, PlanGraph, PlanMismatchError,
                          PlanValidationError, Segment)
from tfremat.planners import make_plan

DATA = pathlib.Path(__file__).parent / "data"


def test_a_plan_written_by_0_1_still_loads_and_validates():
    graph = PlanGraph.from_json(DATA / "graph_v0_1.json")
    plan = Plan.from_json(DATA / "plan_v0_1.json")
    plan.validate(graph)
    raw = json.loads((DATA / "plan_v0_1.json").read_text())
    assert isinstance(plan.estimates, PlanEstimate)
    assert plan.peak_bytes == raw["estimates"]["peak_bytes"]
    assert plan.estimates.overhead == raw["estimates"]["overhead"]
    assert plan.estimates.details["model_peak_bytes"] == raw["estimates"]["model_peak_bytes"]
    # The simulator still agrees with what 0.1 predicted for it, counted as
    # 0.1 counted: the sum of the live buffers, not the allocator's chunks.
    summed = dataclasses.replace(graph, metadata={**graph.metadata, "allocator": None})
    assert simulate(summed, plan).peak_bytes == plan.peak_bytes
    # Written again, it reads back the same.
    assert Plan.from_json(plan.to_json()) == plan


def test_estimates_are_typed_and_round_trip():
    graph = G.unet_like(2)
    plan = make_plan(graph, int(simulate(graph).peak_bytes * 0.7), "approx-dp")
    assert plan.estimates.peak_mb == plan.peak_bytes / 2**20
    again = Plan.from_json(plan.to_json())
    assert again.estimates == plan.estimates and again == plan


def test_a_hand_made_plan_has_no_estimates():
    graph = G.chain(4)
    plan = Plan.from_segments(graph, [[graph.nodes[1].id]])
    assert plan.estimates is None
    with pytest.raises(ValueError, match="no estimates"):
        plan.peak_bytes
    assert Plan.from_json(plan.to_json()) == plan


def test_a_plan_shows_itself_in_one_line_whatever_its_size():
    graph = G.chain(400)
    plan = make_plan(graph, int(simulate(graph).peak_bytes * 0.5), "chen-sqrt")
    shown = repr(plan)
    assert "\n" not in shown and len(shown) < 200
    recomputed = len(plan.recomputed_nodes())
    assert f"segments={len(plan.segments)} ({recomputed} layer calls)" in shown
    assert f"predicted_peak={plan.estimates.peak_mb:,.1f} MiB" in shown
    assert "planner='chen-sqrt'" in shown and "budget=" in shown
    assert "predicted_peak" not in repr(Plan.from_segments(graph, []))


@pytest.mark.parametrize("text, message", [
    ("plan.jsn", "neither an existing file nor JSON text"),
    ("{not json", "not valid JSON"),
    ('{"version": 1, "segments": []', "not valid JSON"),
    ('["a", "list"]', "holds a JSON list, not an object"),
    ('"a string"', "holds a JSON str, not an object"),
    ('{"version": 1}', "has no 'graph_fingerprint'"),
    ('{"version": 7, "graph_fingerprint": "x"}', "Plan version 7 is not supported"),
    ('{"version": 1, "graph_fingerprint": "x", "segments": [{"no": 1}]}', "malformed"),
    ('{"version": 1, "graph_fingerprint": "x", "estimates": {"overhead": 1}}',
     "no 'peak_bytes'"),
])
def test_bad_plan_json_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        Plan.from_json(text)


def test_a_missing_file_is_not_read_as_json(tmp_path):
    with pytest.raises(ValueError, match="neither an existing file nor JSON text"):
        Plan.from_json(str(tmp_path / "nowhere.json"))


def test_mismatch_names_the_structure_not_the_batch_size():
    plan = Plan.from_segments(G.chain(4), [])
    with pytest.raises(PlanMismatchError, match="their connections or their order differ"):
        plan.validate(G.chain(5))


def _renamed(graph: PlanGraph, suffix: str) -> PlanGraph:
    """`graph` with every node id (and layer name) given `suffix`, as Keras
    names the same model built after another one in a process."""
    def ref(r: str) -> str:
        node_id, index = r.rsplit(":", 1)
        return f"{node_id}{suffix}:{index}"

    nodes = [dataclasses.replace(n, id=n.id + suffix, layer=n.layer + suffix,
                                 inputs=[ref(r) for r in n.inputs],
                                 backward_reads=[ref(r) for r in n.backward_reads])
             for n in graph]
    return dataclasses.replace(graph, nodes=nodes, outputs=[ref(r) for r in graph.outputs],
                               outputs_in_place=[ref(r) for r in graph.outputs_in_place])


def test_a_plan_applies_to_the_same_graph_under_other_ids():
    graph = G.resnet_like(4, bn_saved_mib=0.5)
    plan = make_plan(graph, int(simulate(graph).peak_bytes * 0.7), "approx-dp")
    assert plan.segments and plan.node_ids == [n.id for n in graph]
    other = _renamed(graph, "_7")
    assert other.fingerprint() != graph.fingerprint()
    moved = plan.for_graph(other)
    assert moved.segments == [Segment([n + "_7" for n in s.nodes],
                                      [Segment([c + "_7" for c in k.nodes]) for k in s.children])
                              for s in plan.segments]
    moved.validate(other)
    assert moved.for_graph(other) is moved and plan.for_graph(graph) is plan
    assert simulate(other, plan).peak_bytes == simulate(graph, plan).peak_bytes
    # A plan saved as JSON carries its ids, so it moves the same way.
    assert Plan.from_json(plan.to_json()).for_graph(other) == moved
    # The strict check says how to move it.
    with pytest.raises(PlanMismatchError, match=r"plan\.for_graph\(graph\)"):
        plan.validate(other)


def test_offloads_move_with_their_tensors_and_triggers():
    from tfremat.planners.swapping import swap

    graph = G.unet_like(3)
    plan = swap(graph, int(simulate(graph, device_flops=1e5).peak_bytes * 0.7),
                device_flops=1e5)
    assert plan.offloaded and plan.node_ids == [n.id for n in graph]
    other = _renamed(graph, "_2")
    moved = plan.for_graph(other)
    assert [(o.tensor, o.prefetch_after) for o in moved.offloaded] == [
        (o.tensor.replace(":", "_2:"), o.prefetch_after and o.prefetch_after + "_2")
        for o in plan.offloaded]
    before = simulate(graph, plan, device_flops=1e5)
    after = simulate(other, plan, device_flops=1e5)
    assert (after.peak_bytes, after.host_peak_bytes) == (before.peak_bytes,
                                                          before.host_peak_bytes)


def test_a_plan_without_node_ids_is_not_renamed_and_says_why():
    graph = G.chain(4)
    plan = Plan(graph.fingerprint(), segments=[Segment([graph.nodes[1].id])])
    with pytest.raises(PlanMismatchError, match=r"records no node ids.*clear_session"):
        plan.for_graph(_renamed(graph, "_1"))


def test_another_structure_under_the_same_number_of_nodes_is_refused():
    graph = G.resnet_like(3)
    plan = Plan.from_segments(graph, [[graph.nodes[1].id]])
    # The same nodes with one skip connection moved: same count, other edges.
    nodes = list(graph.nodes)
    last = nodes[-1]
    rewired = dataclasses.replace(last, inputs=[f"{nodes[0].id}:0"] * len(last.inputs))
    other = dataclasses.replace(graph, nodes=nodes[:-1] + [rewired])
    with pytest.raises(PlanMismatchError, match="Plan again for this model"):
        plan.for_graph(_renamed(other, "_3"))


def test_budget_error_carries_exact_bytes_and_pickles():
    import pickle

    err = BudgetError(10 * 2**20, 12_345_678, "auto", "Tried: a; b.")
    assert err.min_budget_bytes == 12_345_678 and err.min_budget_mb == 12_345_678 / 2**20
    assert "12345678 bytes" in str(err) and "Tried: a; b." in str(err)
    # 11.77 MiB, rounded up: the budget the message gives is itself feasible.
    assert "smallest feasible budget is 11.8 MiB" in str(err)
    assert "budget is 102.1 MiB" in str(BudgetError(None, 106_959_872, "auto"))
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.min_budget_bytes == err.min_budget_bytes
    measured = pickle.loads(pickle.dumps(BudgetError(2**20, 2**21, "auto", measured=True)))
    assert measured.measured and str(measured) == str(BudgetError(2**20, 2**21, "auto",
                                                                  measured=True))


@pytest.mark.parametrize("budget_bytes, text", [
    (1048, "A budget of 1048 bytes (0.001 MiB) cannot"), (0, "A budget of 0 bytes (0 MiB)"),
    (52_429, "A budget of 0.1 MiB cannot"), (10 * 2**20, "A budget of 10.0 MiB cannot")])
def test_a_budget_error_does_not_round_a_tiny_budget_to_zero(budget_bytes, text):
    """`Planner(budget_mb=0.001)` was told "A budget of 0.0 MiB cannot be met"."""
    assert str(BudgetError(budget_bytes, 2**21, "auto")).startswith(text)


def test_a_budget_error_says_whether_its_minimum_was_predicted_or_measured():
    """A user recovering from a BudgetError must know whether its minimum is a
    prediction (which the device may not meet) or a measurement."""
    predicted = BudgetError(2**20, 2**21, "auto")
    assert not predicted.measured
    assert "as the simulator predicts it, not measured" in str(predicted)
    assert "measure=True" in str(predicted)
    measured = BudgetError(2**20, 2**21, "auto", measured=True)
    assert "measured on the device" in str(measured) and "predicts" not in str(measured)


@pytest.mark.parametrize("segments, message", [
    ([["nope"]], "not in graph"),
    ([[]], "empty"),
])
def test_invalid_plans_are_refused_by_simulate_and_summary(segments, message):
    from tfremat import export

    graph = G.chain(4)
    plan = Plan(graph.fingerprint(), segments=[Segment(s) for s in segments])
    with pytest.raises(PlanValidationError, match=message):
        simulate(graph, plan)
    with pytest.raises(PlanValidationError, match=message):
        export.summary(graph, plan)
    with pytest.raises(PlanValidationError, match=message):
        export.to_pydot(graph, plan)
