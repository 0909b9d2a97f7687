"""Plan pictures and summaries."""

import dataclasses

import keras
import pytest

from tests.marks import needs_graphviz
from tests.planners import graphs as G
from tests.simulation.test_simulator import chain, fig2_graph
import tfremat
from tfremat import Plan, Segment
from tfremat import export
from tfremat.simulation import simulate


def plan_for_chain():
    g = chain(8)
    ids = [f"l{i}" for i in range(8)]
    return g, Plan.from_segments(g, [Segment(ids[0:4], [Segment(ids[0:2])]), ids[4:7]],
                                 planner="manual", budget_bytes=64 * 2**20)


def test_pydot_has_one_cluster_per_segment_and_every_edge():
    g, plan = plan_for_chain()
    dot = export.to_pydot(g, plan)
    text = dot.to_string()
    assert "cluster_segment_0" in text and "cluster_segment_1" in text
    assert "cluster_segment_0.0" in text  # nested segment inside segment 0
    edges = [(e.get_source(), e.get_destination()) for e in dot.get_edges()]
    assert len(edges) == 8
    assert ('"l6"', '"l7"') in edges
    # l4..l6: l6 is read by l7 outside the segment, so only l4 and l5 are dropped.
    assert "recompute segment 1: 3 layers, 2.0 MiB not kept" in text


def test_dot_export_needs_no_graphviz(tmp_path, monkeypatch):
    g, plan = plan_for_chain()
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` on PATH
    path = export.export_dot(plan, str(tmp_path / "plan.dot"), graph=g)
    assert open(path).read().startswith("digraph")


def test_png_without_graphviz_names_the_fix(tmp_path, monkeypatch):
    g, plan = plan_for_chain()
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="apt-get install graphviz"):
        export.export_dot(plan, str(tmp_path / "plan.png"), graph=g)


@needs_graphviz
def test_png_with_graphviz_is_written(tmp_path):
    g, plan = plan_for_chain()
    plan.graph = g
    path = export.export_dot(plan, str(tmp_path / "plan.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_summary_names_the_batch_size_of_an_extracted_step():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)], name="tiny")
    model.compile(optimizer="sgd", loss="mse")
    graph = tfremat.extract(model, batch_size=12)
    plan = tfremat.plan(model, 100, graph=graph)
    assert export.summary(graph, plan).splitlines()[0].endswith(", batch 12")


def test_summary_takes_the_plan_alone_as_export_dot_does():
    g, plan = plan_for_chain()
    carried = dataclasses.replace(plan, graph=g)
    assert export.summary(carried) == export.summary(g, plan)
    assert "l0 .. l3" in export.summary(carried)
    with pytest.raises(TypeError, match=r"summary\(plan\)"):
        export.summary(g)
    with pytest.raises(ValueError, match="carries no PlanGraph"):
        export.summary(dataclasses.replace(plan, graph=None))


def test_unknown_format_is_refused(tmp_path):
    g, plan = plan_for_chain()
    with pytest.raises(ValueError, match="use .dot, .png"):
        export.export_dot(plan, str(tmp_path / "plan.jpg"), graph=g)


def test_summary_lists_segments_and_estimates():
    g, plan = plan_for_chain()
    text = export.summary(g, plan)
    assert "Plan for \"model\" by manual" in text
    assert "segment 0" in text and "segment 1" in text and "1 nested" in text
    assert "Predicted peak" in text and "Extra compute" in text
    # The nested segment has a line of its own, right under its parent's.
    lines = text.splitlines()
    parent = next(i for i, ln in enumerate(lines) if ln.startswith("segment 0"))
    assert lines[parent + 1].split()[:2] == ["nested", "2"]
    assert lines[parent + 1].endswith("l0 .. l1")
    assert lines[parent + 2].startswith("segment 1")
    # The columns are named above the rows, and "nested" is said below them.
    assert lines[parent - 1].split() == ["recomputed", "layers", "not", "kept", "first",
                                         "..", "last", "layer"]
    end = lines[parent - 1].index("layers") + len("layers")
    assert lines[parent][:end].split()[-1] == "4", "a layer count sits under its header"
    assert any(ln.startswith("(nested: recomputed again while the segment above") for ln in lines)


def test_a_segment_does_not_keep_what_its_calls_keep_inside():
    """A subclassed block recomputed on its own keeps its output (the next block
    reads it) but not its intermediates: the summary once said 0 KiB."""
    g = G.subclassed_blocks()  # each block keeps 3 MiB inside, 1 MiB output
    plan = Plan.from_segments(g, [["block_1"]], planner="manual")
    assert "segment 0        1      3.0 MiB  block_1 .. block_1" in export.summary(g, plan)
    assert "1 layers, 3.0 MiB not kept" in export.to_pydot(g, plan).to_string()



def test_a_segment_keeping_under_a_kibibyte_out_of_memory_says_its_bytes():
    """A new user read "0 KiB" in an every-unit plan as a segment saving
    nothing: a lone BatchNormalization keeps its 384 bytes of statistics out."""
    g = chain(4, mb=384 / 2**20)  # each output 384 bytes
    plan = Plan.from_segments(g, [["l0", "l1"]], planner="manual")
    assert "segment 0        2        384 B  l0 .. l1" in export.summary(g, plan)
    big = chain(4, mb=3 / 1024)  # 3 KiB outputs
    assert "segment 0        2        3 KiB  l0 .. l1" in export.summary(
        big, Plan.from_segments(big, [["l0", "l1"]], planner="manual"))

def test_summary_says_whether_and_what_was_measured():
    """A plan returned by `plan(..., measure=True)` shows its measured peak; one
    that was only predicted says so."""
    g, plan = plan_for_chain()
    assert "Measured peak:   not measured" in export.summary(g, plan)
    # Both ways to measure it: the function's and the command line's.
    assert "measure=True" in export.summary(g, plan) and "--measure" in export.summary(g, plan)
    plan.estimates = dataclasses.replace(simulate(g, plan).plan_estimate(), details={
        "unmeasured": "why not"})  # as the Planner says why it measured nothing
    assert "Measured peak:   not measured (why not)" in export.summary(g, plan)
    trials = [{"predicted_bytes": 2**20, "measured_bytes": 3 * 2**20}] * 2
    plan.estimates = dataclasses.replace(simulate(g, plan).plan_estimate(), details={
        "measured_peak_bytes": 3 * 2**20, "trials": trials})
    assert "Measured peak:   3.0 MiB on the device (chosen after 2 measurements)" in export.summary(
        g, plan)
    # A plan predicted above its budget and measured within it says why it was taken.
    predicted = simulate(g, plan).peak_bytes
    plan.budget_bytes = predicted - 1
    plan.estimates = dataclasses.replace(simulate(g, plan).plan_estimate(), details={
        "measured_peak_bytes": predicted - 2})
    assert "above the budget; chosen because it measured within it" in export.summary(g, plan)
    plan.estimates = dataclasses.replace(simulate(g, plan).plan_estimate(), details={
        "measured_peak_bytes": predicted})
    assert "above the budget" not in export.summary(g, plan)


def test_summary_of_an_empty_plan_says_nothing_to_do():
    g = fig2_graph()
    assert "the step fits as it is" in export.summary(g, Plan.from_segments(g, []))


def test_summary_of_a_plan_with_updates_only_says_nothing_is_recomputed():
    g = chain(4)
    text = export.summary(g, Plan.from_segments(g, [], update_in_backward=True))
    assert "Nothing to recompute or offload." in text and "fits as it is" not in text


def test_plan_methods_use_the_graph_they_carry(capsys):
    g, plan = plan_for_chain()
    with pytest.raises(ValueError, match="carries no PlanGraph"):
        plan.summary()
    plan.graph = g
    plan.summary()
    assert "segment 1" in capsys.readouterr().out
    assert plan.to_pydot().get_subgraph("cluster_segment_1")
    # The graph is not part of the plan's JSON.
    assert "graph\"" not in plan.to_json()
