"""The simulator-driven search nesting segments where the peak occurs."""

import pytest

from tfremat.planners import _refine
from tfremat.planners.chen import chen_sqrt
from tfremat.planners.dp import approx_dp
from tfremat.core import Plan, Segment
from tfremat.planners.registry import min_feasible_budget
from tfremat.simulation import simulate

from tests.planners import graphs as G

GRAPHS = {
    "chain": lambda: G.chain(64),
    "resnet": lambda: G.resnet_like(6),
    "unet": lambda: G.unet_like(3),
    "densenet": lambda: G.densenet_like(6),
    "shared": lambda: G.shared_layers(6),
    "random": lambda: G.random_dag(3, 40, extra_edges=6),
}


def peak(graph, segments):
    return simulate(graph, Plan.from_segments(graph, segments)).peak_bytes


def depth(segments):
    return 1 + max((depth(s.children) for s in segments), default=0) if segments else 0


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_lower_peak_keeps_plans_valid_and_never_raises_the_peak(name):
    graph = GRAPHS[name]()
    start = chen_sqrt(graph).segments
    result = _refine.lower_peak(graph, start, None)
    Plan.from_segments(graph, result).validate(graph)
    assert peak(graph, result) <= peak(graph, start)


def test_lower_peak_nests_segments_below_the_flat_floor_of_a_chain():
    graph = G.chain(64)
    start = chen_sqrt(graph).segments
    result = _refine.lower_peak(graph, start, None)
    assert depth(result) >= 2
    assert peak(graph, result) < peak(graph, start)


def test_lower_peak_returns_the_plan_unchanged_when_it_fits_or_may_not_simulate():
    graph = G.chain(64)
    start = chen_sqrt(graph).segments
    assert _refine.lower_peak(graph, start, peak(graph, start)) is start
    assert _refine.lower_peak(graph, start, None, max_evals=1) is start


def test_lower_peak_stops_at_the_first_plan_meeting_the_budget():
    graph = G.chain(64)
    start = chen_sqrt(graph).segments
    lowest = _refine.lower_peak(graph, start, None)
    budget = (peak(graph, start) + peak(graph, lowest)) // 2
    stopped = _refine.lower_peak(graph, start, budget)
    assert peak(graph, lowest) < peak(graph, stopped) <= budget
    extra = simulate(graph, Plan.from_segments(graph, stopped)).extra_compute
    assert extra <= simulate(graph, Plan.from_segments(graph, lowest)).extra_compute


def projection_block():
    """A segment whose shortcut branch (conv, BN) is computed before the main
    branch, so its big conv output outlives the main branch's backward."""
    b = G.Builder("projection")
    x = b.input()
    h = b.layer("Conv2D", [x], cost=10.0, params=1024)
    short = b.layer("Conv2D", [h], mib=4.0, cost=10.0, params=1024)
    short_bn = b.layer("BatchNormalization", [short], mib=4.0, cost=1.0)
    m = h
    for _ in range(3):
        m = b.layer("Conv2D", [m], mib=4.0, cost=10.0, params=1024)
    main = b.layer("ReLU", [m], mib=4.0, cost=1.0, reads="output")
    add = b.layer("Add", [main, short_bn], mib=4.0, cost=1.0, reads="none")
    out = b.layer("Dense", [add], cost=10.0, params=1024)
    graph = b.graph([out], persistent_mib=1.0)
    body = [n.id for n in graph if n.id not in (x, out)]
    return graph, [Segment(body)], short, short_bn


def test_isolating_a_branch_recomputes_it_just_before_its_backward():
    graph, segments, short, short_bn = projection_block()
    isolated = _refine._isolated(graph, segments, short, short_bn)
    assert [c.nodes for c in isolated[0].children] == [[short, short_bn]]
    Plan.from_segments(graph, isolated).validate(graph)
    assert peak(graph, isolated) < peak(graph, segments)
    assert peak(graph, _refine.lower_peak(graph, segments, None)) <= peak(graph, isolated)


def test_memory_centric_dp_reaches_below_the_flat_planners():
    graph = G.chain(64)
    memory = min_feasible_budget(graph, "approx-dp", objective="memory")
    # The time-centric DP falls back on memory-centric plans when its own miss.
    assert memory == min_feasible_budget(graph, "approx-dp", objective="time")
    assert memory < min_feasible_budget(graph, "chen-sqrt")
    plan = approx_dp(graph, memory, objective="memory")
    assert plan.peak_bytes <= memory and plan.estimates.details["refined"]
    assert depth(plan.segments) >= 2
