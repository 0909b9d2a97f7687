"""Kusumoto et al. 2019 DP planners: exactness against brute force, the
approximate DP against the exact one, the simulator search, time limits."""

import itertools
import math
import time

import pytest
from hypothesis import given, settings, strategies as st

from tfremat.core import BudgetError
from tfremat.planners import _dp_approx
from tfremat.planners._dp_exact import Deadline, ExactDP
from tfremat.planners._dp_model import DPModel
from tfremat.planners.dp import DPTimeout, approx_dp, exact_dp
from tfremat.simulation import simulate

from tests.planners import graphs as G

MIB = 2**20


# -- brute force: Kusumoto Sec. 4.1, written independently from sets ---------------


def brute_force(graph):
    """Every increasing lower-set sequence ending at V: list of (overhead, peak)."""
    nodes = [n for n in graph if not n.is_input]
    names = [n.id for n in nodes]
    succ = {v: {w for w in names if v in graph.predecessors(w)} for v in names}
    pred = {v: {p for p in graph.predecessors(v) if p in succ} for v in names}
    mem = {n.id: n.output_bytes + n.internal_saved_bytes for n in nodes}
    cost = {n.id: n.forward_cost for n in nodes}
    sinks = {ref.rsplit(":", 1)[0] for ref in graph.outputs}
    full = frozenset(names)
    # Weight gradients alive at each call's backward: all made so far (the test
    # graphs are shorter than the simulator's 24-gradient window).
    needs_grad, made, wgrad = {}, 0, {}
    for n in nodes:
        needs_grad[n.id] = n.param_bytes > 0 or any(needs_grad[p] for p in pred[n.id])
    for n in reversed(nodes):
        made += n.param_bytes if needs_grad[n.id] else 0
        wgrad[n.id] = made if needs_grad[n.id] else 0
    lowers = [frozenset(c) for r in range(1, len(names) + 1)
              for c in itertools.combinations(names, r)
              if all(pred[v] <= set(c) for v in c)]

    def boundary(low):
        out = {v for v in low if succ[v] - low}
        return out | (low & sinks) if low != full else out

    def m(s):
        return sum(mem[v] for v in s)

    results = []

    def visit(prev, cached, overhead, peak):
        if prev == full:
            results.append((overhead, peak))
            return
        for low in lowers:
            if not prev < low:
                continue
            block = low - prev
            plus = set().union(*(succ[v] for v in low)) - low
            minus = set().union(*(pred[w] for w in plus)) - low
            here = (m(cached) + 2 * m(block) + m(plus) + m(minus)
                    + graph.total_persistent_bytes + wgrad[max(block, key=names.index)])
            drops = block - boundary(low)
            step = sum(cost[v] for v in block) if drops and low != full else 0.0
            visit(low, cached | (boundary(low) & block), overhead + step, max(peak, here))

    visit(frozenset(), frozenset(), 0.0, 0)
    return results


@st.composite
def small_dags(draw):
    n = draw(st.integers(2, 7))
    b = G.Builder("hyp")
    ids = [b.input()]
    for i in range(1, n + 1):
        extra = draw(st.sets(st.integers(0, i - 1), max_size=2))
        inputs = sorted({i - 1} | extra)
        ids.append(b.layer(draw(st.sampled_from(["Dense", "ReLU"])),
                           [ids[j] for j in inputs],
                           mib=draw(st.sampled_from([0.5, 1.0, 2.0])),
                           cost=float(draw(st.integers(1, 9))),
                           saved_mib=draw(st.sampled_from([0.0, 0.5])),
                           params=draw(st.sampled_from([0, 0, MIB // 4, MIB]))))
    outputs = [ids[-1]] + ([ids[n // 2]] if draw(st.booleans()) and n > 2 else [])
    return b.graph(outputs, persistent_mib=0.25)


@settings(max_examples=60, deadline=None)
@given(small_dags(), st.floats(0.0, 1.0))
def test_exact_dp_equals_brute_force(graph, where):
    runs = brute_force(graph)
    floor = min(p for _, p in runs)
    top = max(p for _, p in runs)
    budget = floor + where * (top - floor)
    feasible = [t for t, p in runs if p <= budget]
    dp = ExactDP(DPModel.of(graph), Deadline(None))
    assert dp.solve(math.inf, "peak").peak == floor
    best = dp.solve(budget, "time")
    assert best.overhead == pytest.approx(min(feasible))
    assert best.peak <= budget
    most = dp.solve(budget, "memory")
    assert most.overhead == pytest.approx(max(feasible))
    assert dp.solve(floor - 1, "time") is None


@settings(max_examples=60, deadline=None)
@given(small_dags(), st.floats(0.0, 1.0))
def test_approx_dp_never_beats_exact_dp(graph, where):
    model = DPModel.of(graph)
    exact = ExactDP(model, Deadline(None))
    tables = _dp_approx.PairTables(model)
    floor = exact.solve(math.inf, "peak").peak
    approx_floor = _dp_approx.solve(model, tables, math.inf, "peak")
    assert approx_floor.peak >= floor
    budget = floor + where * floor
    ex = exact.solve(budget, "time")
    ap = _dp_approx.solve(model, tables, budget, "time")
    if ap is not None:
        assert ap.overhead >= ex.overhead - 1e-9
        assert model.evaluate(ap.sequence) == (pytest.approx(ap.overhead), ap.peak)
        assert ap.peak <= budget
        ap_most = _dp_approx.solve(model, tables, budget, "memory")
        assert ap_most.overhead <= exact.solve(budget, "memory").overhead + 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_approx_dp_matches_exact_dp_on_random_dags(seed):
    graph = G.random_dag(seed, 14, extra_edges=3)
    model = DPModel.of(graph)
    exact = ExactDP(model, Deadline(None))
    tables = _dp_approx.PairTables(model)
    floor = exact.solve(math.inf, "peak").peak
    for factor in (1.0, 1.2, 1.5):
        ex = exact.solve(floor * factor, "time")
        ap = _dp_approx.solve(model, tables, floor * factor, "time")
        assert ap is None or ap.overhead >= ex.overhead - 1e-9


# -- planners -------------------------------------------------------------------------


GRAPHS = {
    "chain": lambda: G.chain(40),
    "resnet": lambda: G.resnet_like(4),
    "unet": lambda: G.unet_like(3),
    "densenet": lambda: G.densenet_like(5),
    "shared": lambda: G.shared_layers(6),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("planner", [approx_dp, exact_dp])
@pytest.mark.parametrize("objective", ["time", "memory"])
def test_dp_plans_are_valid_and_fit_or_raise_a_feasible_minimum(name, planner, objective):
    graph = GRAPHS[name]()
    base = simulate(graph).peak_bytes
    for fraction in (0.9, 0.6, 0.3):
        budget = int(base * fraction)
        try:
            plan = planner(graph, budget, objective=objective)
        except BudgetError as err:
            minimum = err.min_budget_bytes
            assert minimum > budget
            plan = planner(graph, minimum, objective=objective)
            budget = minimum
        plan.validate(graph)
        assert plan.peak_bytes == simulate(graph, plan).peak_bytes
        assert plan.peak_bytes <= budget
        assert plan.budget_bytes == budget and plan.settings["objective"] == objective


def test_time_centric_returns_no_segments_when_the_step_fits():
    graph = G.resnet_like(3)
    plan = approx_dp(graph, simulate(graph).peak_bytes)
    assert plan.segments == [] and plan.estimates.overhead == 0


def test_memory_centric_uses_coarser_blocks_and_less_memory_than_time_centric():
    graph = G.chain(30)
    budget = int(simulate(graph).peak_bytes * 0.9)
    time_plan = exact_dp(graph, budget, objective="time")
    memory_plan = exact_dp(graph, budget, objective="memory")
    assert memory_plan.peak_bytes < time_plan.peak_bytes
    assert memory_plan.estimates.overhead > time_plan.estimates.overhead


def test_time_centric_trusts_the_simulator_over_eq2():
    # Eq. (2) overestimates the liveness simulator here, so the DP's own budget
    # is searched above the user's budget.
    graph = G.resnet_like(3)
    budget = int(simulate(graph).peak_bytes * 0.7)
    plan = approx_dp(graph, budget)
    assert plan.peak_bytes <= budget
    assert plan.estimates.details["model_peak_bytes"] > budget


def wide_graph(branches):
    """One input feeding `branches` parallel calls: 2**branches lower sets."""
    b = G.Builder("wide")
    x = b.input()
    return b.graph([b.layer("Dense", [x]) for _ in range(branches)])


def test_exact_dp_time_limit_raises_dp_timeout():
    graph = wide_graph(16)  # 65,536 lower sets: enumerated fast, solved slowly
    start = time.monotonic()
    with pytest.raises(DPTimeout, match="did not finish within 0.3 s") as info:
        exact_dp(graph, 10**12, objective="memory", time_limit=0.3)
    assert time.monotonic() - start < 3
    assert info.value.lower_sets == 2**16
    assert "approx-dp" in str(info.value)


def test_exact_dp_gives_up_on_too_many_lower_sets():
    with pytest.raises(DPTimeout, match="more than 1,000,000 lower sets"):
        exact_dp(wide_graph(40), 10**12, time_limit=None)


def test_approx_dp_on_a_500_node_resnet_is_fast():
    graph = G.resnet_like(50)
    assert len(graph) == 501
    model = DPModel.of(graph)
    start = time.perf_counter()
    tables = _dp_approx.PairTables(model)
    result = _dp_approx.solve(model, tables, 150 * MIB, "time")
    one_run = time.perf_counter() - start
    assert result is not None
    start = time.perf_counter()
    plan = approx_dp(graph, int(simulate(graph).peak_bytes * 0.5))
    whole = time.perf_counter() - start
    plan.validate(graph)
    assert one_run < 5 and whole < 5, (one_run, whole)


# -- the exact DP is never worse than the approximate one under the simulator --------


def assert_exact_at_least_as_good(graph, budget, objective):
    """At `budget`, exact-dp fits whenever approx-dp does, with no more overhead
    (time) or no higher simulated peak (memory); at budget 0 its minimum
    feasible budget is no higher."""
    outcomes = {}
    for planner in (exact_dp, approx_dp):
        try:
            outcomes[planner] = planner(graph, budget, objective=objective)
        except BudgetError as err:
            outcomes[planner] = err
    exact, approx = outcomes[exact_dp], outcomes[approx_dp]
    if isinstance(approx, BudgetError):
        if isinstance(exact, BudgetError):
            assert exact.min_budget_bytes <= approx.min_budget_bytes
        return
    assert not isinstance(exact, BudgetError), (exact, approx.peak_bytes)
    assert exact.peak_bytes <= budget
    assert exact.planner == "exact-dp" and exact.estimates.details["dp"] in ("exact", "approx")
    if objective == "time":
        assert exact.estimates.overhead <= approx.estimates.overhead + 1e-12
    else:
        assert exact.peak_bytes <= approx.peak_bytes


@settings(max_examples=30, deadline=None)
@given(small_dags(), st.floats(0.0, 1.2), st.sampled_from(["time", "memory"]))
def test_exact_dp_is_never_worse_than_approx_dp_under_the_simulator(graph, where, objective):
    base = simulate(graph).peak_bytes
    assert_exact_at_least_as_good(graph, 0, objective)
    assert_exact_at_least_as_good(graph, int(base * where), objective)


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("objective", ["time", "memory"])
def test_exact_dp_is_never_worse_than_approx_dp_on_benchmark_like_graphs(name, objective):
    graph = GRAPHS[name]()
    base = simulate(graph).peak_bytes
    for fraction in (0.0, 0.3, 0.45, 0.6, 0.9):
        assert_exact_at_least_as_good(graph, int(base * fraction), objective)
