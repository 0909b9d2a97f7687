"""Chen et al. 2016 planners on synthetic graphs, judged by the simulator."""

import math

import pytest

from tfremat.core import BudgetError
from tfremat.planners.chen import chen_drop_cheap, chen_greedy, chen_recursive, chen_sqrt
from tfremat.simulation import simulate

from tests.planners import graphs as G

MIB = 2**20


@pytest.mark.parametrize("n", [16, 100, 400])
def test_sqrt_cuts_a_chain_into_about_sqrt_n_segments(n):
    plan = chen_sqrt(G.chain(n))
    plan.validate(G.chain(n))
    parts = len(plan.segments) + 1  # the last part is not recomputed
    assert abs(parts - math.sqrt(n)) <= 1
    sizes = [len(s.nodes) for s in plan.segments]
    assert max(sizes) - min(sizes) <= 1


def test_sqrt_reduces_a_chain_peak_to_about_two_sqrt_n():
    graph = G.chain(100)
    plan = chen_sqrt(graph)
    assert simulate(graph).peak_bytes > 100 * MIB
    assert plan.peak_bytes <= 2 * 10 * MIB + 2 * MIB
    # ~one forward: nine segments of ten layers recompute nine each (the last
    # one's output only the next segment's backward reads: not recomputed).
    assert [len(s.nodes) for s in plan.segments] == [10] * 9
    assert plan.estimates.overhead == pytest.approx(81 / 300)


def test_sqrt_on_a_resnet_cuts_only_between_blocks():
    graph = G.resnet_like(9)
    plan = chen_sqrt(graph)
    plan.validate(graph)
    # Blocks after the first (whose skip is the input) end in add or relu.
    ends = [s.nodes[-1] for s in plan.segments[1:]]
    assert all(e.startswith(("add", "relu")) for e in ends)
    assert plan.peak_bytes < simulate(graph).peak_bytes


def test_sqrt_raises_budget_error_below_its_peak():
    graph = G.chain(36)
    peak = chen_sqrt(graph).peak_bytes
    with pytest.raises(BudgetError) as info:
        chen_sqrt(graph, peak - 1)
    assert info.value.min_budget_mb == peak / MIB
    assert chen_sqrt(graph, peak).peak_bytes == peak


def test_greedy_returns_least_overhead_plan_within_budget():
    graph = G.resnet_like(12)
    base = simulate(graph).peak_bytes
    loose = chen_greedy(graph, int(base * 0.8))
    tight = chen_greedy(graph, int(base * 0.5))
    for plan, budget in [(loose, base * 0.8), (tight, base * 0.5)]:
        plan.validate(graph)
        assert plan.peak_bytes <= budget
    assert loose.estimates.overhead <= tight.estimates.overhead
    assert "B" in tight.settings


def test_greedy_budget_error_minimum_is_feasible():
    graph = G.unet_like(3)
    with pytest.raises(BudgetError) as info:
        chen_greedy(graph, 1)
    assert "smallest feasible budget" in str(info.value)
    minimum = info.value.min_budget_bytes
    plan = chen_greedy(graph, minimum)
    assert plan.peak_bytes == minimum


def test_drop_cheap_recomputes_only_cheap_calls():
    graph = G.resnet_like(6, bn_saved_mib=1.0)
    plan = chen_drop_cheap(graph)
    plan.validate(graph)
    assert plan.segments
    recomputed = {graph.node(n).class_name for s in plan.segments for n in s.nodes}
    assert recomputed <= {"BatchNormalization", "ReLU", "Add"}
    assert plan.peak_bytes < simulate(graph).peak_bytes
    assert plan.estimates.overhead < 0.02


def test_drop_cheap_keeps_everything_when_no_call_is_cheap():
    plan = chen_drop_cheap(G.chain(20))
    assert plan.segments == []


def test_drop_cheap_skips_runs_that_would_keep_more_than_they_drop():
    # ReLU backward reads its output, so BN's output is freed without a plan;
    # a [bn, relu] segment would only add its input to what is kept.
    graph = G.resnet_like(4)
    plan = chen_drop_cheap(graph)
    assert plan.peak_bytes <= simulate(graph).peak_bytes


def test_recursive_uses_less_memory_than_sqrt_on_a_long_chain():
    graph = G.chain(256)
    rec = chen_recursive(graph, fanout=1)
    rec.validate(graph)
    sqrt = chen_sqrt(graph)
    assert rec.peak_bytes < sqrt.peak_bytes
    assert rec.peak_bytes <= 2 * math.log2(256) * MIB + 4 * MIB
    assert rec.estimates.overhead > sqrt.estimates.overhead


def test_recursive_nests_segments():
    plan = chen_recursive(G.chain(64), fanout=1)
    depth, level = 0, plan.segments
    while level:
        depth += 1
        level = [c for s in level for c in s.children]
    assert depth >= 4


def test_recursive_picks_least_overhead_fanout_within_budget():
    graph = G.chain(128)
    plans = {k: chen_recursive(graph, fanout=k) for k in (1, 2, 3)}
    budget = max(p.peak_bytes for p in plans.values())
    chosen = chen_recursive(graph, budget)
    assert chosen.estimates.overhead == min(p.estimates.overhead
                                               for p in plans.values())


@pytest.mark.parametrize("planner", [chen_sqrt, chen_drop_cheap, chen_recursive])
def test_chen_planners_keep_shared_layers_whole(planner):
    graph = G.shared_layers(8)
    plan = planner(graph)
    plan.validate(graph)
    calls = {"shared@0", "shared@1", "shared@2", "shared@3"}
    for s in plan.segments:
        assert not calls & set(s.nodes) or calls <= set(s.nodes)
