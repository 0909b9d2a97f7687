"""The memory timeline picture (matplotlib, no Graphviz)."""

import pytest

from tests.simulation.test_simulator import chain
from tfremat import Offload, Plan, plot_memory, simulate
from tfremat import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def chain_plan(offload: bool = False) -> tuple:
    g = chain(16)
    ids = [f"l{i}" for i in range(16)]
    plan = Plan.from_segments(g, [ids[0:4], ids[4:8]], planner="manual",
                              budget_bytes=14 * 2**20)
    if offload:
        plan.offloaded = [Offload("l10:0", prefetch_after="l12")]
    return g, plan


def line(fig, label_start: str):
    """The line of the figure's first axes whose label starts with `label_start`."""
    found = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith(label_start)]
    assert len(found) == 1, [ln.get_label() for ln in fig.axes[0].get_lines()]
    return found[0]


def test_plotted_peaks_are_the_simulated_peaks():
    g, plan = chain_plan()
    fig = plots.memory_figure(g, plan, measured_mb=[13.0, 13.5])
    assert max(line(fig, plots.PLAIN_LABEL).get_ydata()) == pytest.approx(
        simulate(g).peak_bytes / 2**20)
    planned = line(fig, plots.PLANNED_LABEL).get_ydata()
    assert max(planned) == pytest.approx(simulate(g, plan).peak_bytes / 2**20)
    assert len(planned) == len(simulate(g, plan).timeline)
    assert list(line(fig, plots.BUDGET_LABEL).get_ydata()) == [14.0, 14.0]
    measured = [ln for ln in fig.axes[0].get_lines() if ln.get_color() == "#2ca02c"]
    assert sorted(ln.get_ydata()[0] for ln in measured) == [13.0, 13.5]
    assert "13.0, 13.5 MiB" in line(fig, plots.MEASURED_LABEL).get_label()


def test_the_plain_line_meets_the_planned_one_at_the_same_layer_calls():
    """A new user read the two lines call by call and found them shifted after
    the first recomputation: the plain step has no recompute steps."""
    g, plan = chain_plan()
    fig = plots.memory_figure(g, plan)
    planned_labels = [label for label, _ in simulate(g, plan).timeline]
    xs = list(line(fig, plots.PLAIN_LABEL).get_xdata())
    for x, (label, _) in zip(xs, simulate(g).timeline):
        assert planned_labels[x] == label
    assert xs[-1] == len(planned_labels) - 1 > len(xs) - 1  # the update, after the recomputes


def test_recompute_spans_are_shaded_once_per_segment():
    g, plan = chain_plan()
    fig = plots.memory_figure(g, plan)
    spans = [p for p in fig.axes[0].patches if p.get_facecolor()[:3] != (1.0, 1.0, 1.0)]
    # Two segments, each recomputed in one contiguous run before its backward.
    assert len(spans) == 2


def test_offloaded_tensors_are_marked():
    g, plan = chain_plan(offload=True)
    fig = plots.memory_figure(g, plan)
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert any(lb.startswith("offloaded to host") for lb in labels)
    assert any(t.get_text() == "l10" for t in fig.axes[0].texts)


def test_plot_memory_writes_a_png_without_graphviz(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot`
    g, plan = chain_plan()
    path = plot_memory(plan, tmp_path / "memory.png", graph=g)
    assert path == str(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG_MAGIC
    assert plots.memory_png(g, plan)[:8] == PNG_MAGIC


def test_plan_plot_timeline_uses_the_graph_it_carries(tmp_path):
    g, plan = chain_plan()
    with pytest.raises(ValueError, match="carries no PlanGraph"):
        plan.plot_timeline(tmp_path / "m.png")
    plan.graph = g
    assert plan.plot_timeline(tmp_path / "m.svg").endswith("m.svg")
    assert (tmp_path / "m.svg").read_text().lstrip().startswith("<?xml")


def test_an_empty_plan_draws_the_plain_step_and_the_budget():
    g, _ = chain_plan()
    plan = Plan.from_segments(g, [], budget_bytes=40 * 2**20)
    fig = plots.memory_figure(g, plan)
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert any(lb.startswith(plots.PLAIN_LABEL) for lb in labels)
    assert not any(lb.startswith(plots.PLANNED_LABEL) for lb in labels)
    assert any(lb.startswith(plots.BUDGET_LABEL) for lb in labels)


def test_a_budget_given_replaces_the_plans_own():
    g, plan = chain_plan()
    fig = plots.memory_figure(g, plan, budget_mb=20.0)
    assert list(line(fig, plots.BUDGET_LABEL).get_ydata()) == [20.0, 20.0]
