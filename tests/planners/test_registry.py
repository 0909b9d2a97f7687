"""The planner registry and "auto": every plan valid, within budget, or a
BudgetError whose minimum can be planned for."""

import pathlib
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

from tfremat.core import BudgetError
from tfremat.core import Plan
from tfremat.planners.registry import PLANNERS, make_plan, min_feasible_budget
from tfremat.simulation import simulate

from tests.planners import graphs as G

MIB = 2**20
ROOT = pathlib.Path(__file__).resolve().parents[2]

GRAPHS = {
    "chain": lambda: G.chain(50),
    "resnet": lambda: G.resnet_like(5, bn_saved_mib=0.5),
    "unet": lambda: G.unet_like(3),
    "densenet": lambda: G.densenet_like(5),
    "shared": lambda: G.shared_layers(6),
    "random": lambda: G.random_dag(7, 30, extra_edges=6),
}


def test_registry_names_the_planners():
    assert set(PLANNERS) == {"chen-sqrt", "chen-greedy", "chen-drop-cheap",
                             "chen-recursive", "exact-dp", "approx-dp", "swap", "dqn",
                             "every-unit"}


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("planner", ["auto", *sorted(PLANNERS)])
def test_every_plan_is_valid_and_meets_its_budget(planner, graph_name):
    graph = GRAPHS[graph_name]()
    budget = int(simulate(graph).peak_bytes * 0.7)
    try:
        plan = make_plan(graph, budget, planner)
    except BudgetError as err:
        minimum = err.min_budget_bytes
        assert minimum > budget
        # The figure stated is itself feasible: the minimum rounded up to 0.1 MiB.
        stated = float(re.search(r"smallest feasible budget is ([\d.]+) MiB", str(err))[1])
        assert err.min_budget_mb <= stated < err.min_budget_mb + 0.1
        plan = make_plan(graph, minimum, planner)
        budget = minimum
    plan.validate(graph)
    assert plan.budget_bytes == budget
    assert plan.planner in PLANNERS
    assert plan.peak_bytes == simulate(graph, plan).peak_bytes <= budget
    assert plan.estimates.overhead == simulate(graph, plan).overhead
    assert plan.estimates.extra_compute == simulate(graph, plan).extra_compute
    assert Plan.from_json(plan.to_json()) == plan


def test_auto_returns_an_empty_plan_when_the_step_fits():
    graph = G.resnet_like(3)
    plan = make_plan(graph, simulate(graph).peak_bytes)
    assert plan.is_empty and plan.planner == "auto"
    assert "no rewrite needed" in plan.estimates.note
    assert plan.estimates.overhead == 0


def test_auto_budget_error_carries_the_minimum_across_planners():
    graph = G.chain(40)
    minimum = min_feasible_budget(graph)
    with pytest.raises(BudgetError) as info:
        make_plan(graph, minimum - 1)
    assert info.value.min_budget_mb == minimum / MIB
    assert all(name in str(info.value) for name in ("approx-dp", "chen-recursive", "every-unit"))
    plan = make_plan(graph, minimum)
    assert plan.peak_bytes <= minimum
    # Nesting where the peak occurs reaches below one level of segments on a chain.
    assert minimum < min_feasible_budget(graph, "chen-greedy")


def test_auto_budget_error_names_the_shared_layers_that_limit_it():
    graph = G.shared_layers()
    with pytest.raises(BudgetError, match=r"called more than once \(") as info:
        make_plan(graph, min_feasible_budget(graph) - 1)
    shared = {n.layer for n in graph.nodes if sum(m.layer == n.layer for m in graph.nodes) > 1}
    assert shared and all(layer in str(info.value) for layer in sorted(shared)[:4])
    with pytest.raises(BudgetError) as plain:
        make_plan(G.chain(40), min_feasible_budget(G.chain(40)) - 1)
    assert "called more than once" not in str(plain.value)


@pytest.mark.parametrize("planner", ["auto", "chen-sqrt", "approx-dp"])
def test_a_budget_error_names_a_call_whose_workspace_no_plan_lowers(planner):
    graph = G.chain(20, persistent_mib=3.0)
    wide = graph.nodes[10]
    wide.backward_workspace_bytes = 64 * MIB  # far above all activations
    wide.class_name = "TimeDistributed"
    with pytest.raises(BudgetError) as info:
        make_plan(graph, min_feasible_budget(graph, planner) - 1, planner)
    text = str(info.value)
    assert f"The backward pass of {wide.id!r} (TimeDistributed) alone needs 64.0 MiB" in text
    assert "Dense and EinsumDense act on the last axis" in text
    assert f"keeps the {graph.total_persistent_bytes / MIB:,.1f} MiB of weights" in text
    # Where no one call weighs that much, none is named.
    with pytest.raises(BudgetError) as plain:
        make_plan(G.chain(20), min_feasible_budget(G.chain(20), planner) - 1, planner)
    assert "alone needs" not in str(plain.value)


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_min_feasible_budget_is_tight(planner):
    graph = G.resnet_like(4)
    minimum = min_feasible_budget(graph, planner)
    plan = make_plan(graph, minimum, planner)
    assert plan.peak_bytes <= minimum
    with pytest.raises(BudgetError):
        make_plan(graph, minimum - 1, planner)


def test_exact_dp_timeout_falls_back_to_approx_dp_with_a_warning():
    wide = G.Builder("wide")
    x = wide.input()
    graph = wide.graph([wide.layer("Dense", [x]) for _ in range(40)])
    with pytest.warns(UserWarning, match="Falling back to the approximate DP"):
        plan = make_plan(graph, 10**12, "exact-dp", time_limit=0.1)
    assert plan.planner == "approx-dp"


def test_objective_reaches_the_dp_planners():
    graph = G.chain(30)
    budget = int(simulate(graph).peak_bytes * 0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memory = make_plan(graph, budget, "approx-dp", objective="memory")
    assert memory.settings["objective"] == "memory"
    time_plan = make_plan(graph, budget, "approx-dp", objective="time")
    assert memory.estimates.overhead > time_plan.estimates.overhead


def test_unknown_planner_or_objective_is_refused():
    graph = G.chain(4)
    with pytest.raises(ValueError, match="Unknown planner"):
        make_plan(graph, 10**9, "magic")
    with pytest.raises(ValueError, match="Unknown objective"):
        make_plan(graph, 10**9, objective="fast")


def test_planners_and_simulator_run_without_tensorflow_or_keras():
    code = textwrap.dedent("""
        import importlib.abc, sys

        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("tensorflow", "keras"):
                    raise ImportError(f"No module named {name!r}")

        sys.meta_path.insert(0, Absent())
        import tfremat
        from tfremat.planners import make_plan
        from tests.planners import graphs
        graph = graphs.chain(12)
        plan = make_plan(graph, int(tfremat.simulate(graph).peak_bytes * 0.7))
        assert plan.segments and tfremat.simulate(graph, plan).peak_bytes <= plan.budget_bytes
        try:
            tfremat.extract
        except tfremat.BackendError as e:
            assert "needs TensorFlow" in str(e)
        else:
            raise AssertionError("extract without TensorFlow did not say so")
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("planner", ["exact-dp", "approx-dp"])
def test_verbose_dp_shows_rich_progress(planner, capsys):
    graph = G.unet_like(2)
    budget = int(simulate(graph).peak_bytes * 0.8)
    quiet = make_plan(graph, budget, planner)
    loud = make_plan(graph, budget, planner, verbose=2)
    assert "DP" in capsys.readouterr().out
    assert loud.segments == quiet.segments


@pytest.mark.parametrize("planner", ["auto", "chen-sqrt"])
def test_a_plan_from_make_plan_carries_its_graph_for_summary(planner, capsys):
    graph = G.chain(20)
    plan = make_plan(graph, min_feasible_budget(graph, planner), planner)
    assert plan.graph is graph
    plan.summary()
    assert plan.planner in capsys.readouterr().out


@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
def test_every_budget_the_auto_error_lists_is_met_by_that_planner(graph_name):
    # A user copies a planner's figure from the list: it must plan, not refuse.
    graph = GRAPHS[graph_name]()
    with pytest.raises(BudgetError) as info:
        make_plan(graph, min_feasible_budget(graph) - 1)
    listed = re.findall(r"(?:^|; )([a-z-]+)(?: \((time|memory)\))?: ([\d.]+) MiB",
                        str(info.value).split("Smallest budget each meets, as predicted: ")[1])
    assert {"approx-dp", "chen-sqrt"} <= {name for name, _, _ in listed}
    for name, objective, mib in listed:
        plan = make_plan(graph, int(float(mib) * MIB), name,
                         **({"objective": objective} if objective else {}))
        assert plan.peak_bytes <= float(mib) * MIB
