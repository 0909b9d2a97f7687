"""The DQN planner: valid plans within budget (or auto's, with a warning) and within
the host budget, the shipped weights reproduce the committed benchmark rows, training
lowers the loss, fine-tuning stops at its time limit, and bad weights or settings are
refused clearly."""

import json
import pathlib
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from tfremat.core import BudgetError, Plan, PlanGraph
from tfremat.planners import dqn, make_plan, min_feasible_budget
from tfremat.planners.deepq import SHIPPED_WEIGHTS, network, synthetic
from tfremat.planners.deepq.agent import Agent, _state_batch
from tfremat.planners.deepq.features import FEATURES_VERSION, describe
from tfremat.simulation import simulate

from tests.planners import graphs as G

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = pathlib.Path(__file__).parent / "data"

RANDOM_GRAPHS = {
    "random_dag": lambda: G.random_dag(3, 40, extra_edges=8),
    "resnet": lambda: G.resnet_like(4, bn_saved_mib=0.5),
    "unet": lambda: G.unet_like(3),
    "synthetic_transformer": lambda: synthetic.transformer(np.random.default_rng(1), 4),
    "synthetic_residual": lambda: synthetic.residual(np.random.default_rng(2), 5),
}


def dqn_plan_or_none(graph, budget: int, **settings):
    """dqn's plan for `budget`, or None when it refuses the budget and `auto`
    with the same settings refuses it too (asserted)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return dqn(graph, budget, **settings)
        except BudgetError:
            with pytest.raises(BudgetError):
                make_plan(graph, budget, "auto", **settings)
            return None


@pytest.mark.parametrize("share", [0.5, 0.75])
@pytest.mark.parametrize("name", sorted(RANDOM_GRAPHS))
def test_plans_are_valid_and_within_budget_or_autos_with_a_warning(name, share):
    graph = RANDOM_GRAPHS[name]()
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + share * plain.activation_peak_bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = dqn(graph, budget)
        except BudgetError:  # neither the agent nor auto meets it
            with pytest.raises(BudgetError):
                make_plan(graph, budget, "auto", offload=True)
            return
    plan.validate(graph)
    assert plan.planner == "dqn" and plan.budget_bytes == budget
    est = simulate(graph, plan)
    assert est.peak_bytes == plan.peak_bytes <= budget
    assert Plan.from_json(plan.to_json()) == plan
    fell_back = "fallback" in plan.estimates.details
    assert fell_back == any("using the plan of planner 'auto'" in str(w.message) for w in caught)
    if fell_back:
        auto = make_plan(graph, budget, "auto", offload=True)
        assert (plan.segments, plan.offloaded) == (auto.segments, auto.offloaded)
        assert plan.estimates.details["agent_peak_bytes"] > budget


def test_an_agent_that_never_acts_falls_back_to_auto_with_a_warning(tmp_path):
    zeros = {k: np.zeros_like(v) for k, v in network.load_weights(SHIPPED_WEIGHTS)[0].items()}
    network.save_weights(tmp_path / "zeros.npz", zeros)
    graph = G.resnet_like(4)
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + 0.6 * plain.activation_peak_bytes)
    with pytest.warns(UserWarning, match="using the plan of planner 'auto' instead"):
        plan = dqn(graph, budget, weights=tmp_path / "zeros.npz")
    assert plan.estimates.details["fallback"] == "auto"
    assert plan.estimates.details["actions"] == {"swap": 0, "remove": 0}
    assert plan.peak_bytes <= budget and not plan.is_empty


def test_shipped_weights_reproduce_the_committed_benchmark_rows():
    committed = json.loads((ROOT / "benchmarks" / "results" / "dqn.json").read_text())
    rows = next(m for m in committed["models"] if m["model"].startswith("UNet"))
    graph = PlanGraph.from_json(DATA / "unet_256px_batch8.json")
    assert len(graph) == rows["nodes"] and simulate(graph).peak_bytes == rows["peak"]
    for cell in rows["budgets"]:
        want = cell["rows"]["dqn"]
        if want["overhead"] is None:  # neither the agent nor auto met it
            with pytest.raises(BudgetError) as info:
                dqn(graph, cell["budget"])
            assert info.value.min_budget_bytes == want["peak"]
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = dqn(graph, cell["budget"])
        details = plan.estimates.details
        if "fallback" in details:
            assert not want["met"]
            assert details["agent_peak_bytes"] == want["peak"]
            assert details["agent_overhead"] == pytest.approx(want["overhead"], rel=1e-9)
        else:
            est = simulate(graph, plan)
            assert want["met"] and est.peak_bytes == want["peak"]
            assert est.step_seconds / est.baseline_seconds - 1 == pytest.approx(
                want["overhead"], rel=1e-9)


def test_training_from_the_seed_for_a_few_episodes_lowers_the_loss():
    rng = np.random.default_rng(0)
    views = [describe(synthetic.random_graph(rng, 10, 20)) for _ in range(4)]
    tasks = [(v, synthetic.random_budget(rng, v.graph)) for v in views]
    agent = Agent(network.init_params(rng), seed=0, batch_size=16)
    losses = agent.train(tasks, episodes=30)
    assert len(losses) > 40
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    view = describe(synthetic.unet(rng, 2))
    params = {k: v.astype(np.float64) for k, v in network.init_params(rng).items()}
    x = view.features(np.zeros(view.size, dtype=np.int64), 2)
    batch, _ = _state_batch([(view, x, 2, (0, 1, 2)), (view, x, 5, (0, 2))])
    batch.x, batch.weight = batch.x.astype(np.float64), batch.weight.astype(np.float64)
    q, cache = network.forward(params, batch)
    dq = rng.normal(size=q.shape)
    grads = network.backward(params, batch, cache, dq)
    for name in network.NAMES:
        index = tuple(int(rng.integers(s)) for s in params[name].shape)
        old = params[name][index]
        params[name][index] = old + 1e-6
        up = dq @ network.forward(params, batch)[0]
        params[name][index] = old - 1e-6
        down = dq @ network.forward(params, batch)[0]
        params[name][index] = old
        assert (up - down) / 2e-6 == pytest.approx(grads[name][index], rel=1e-4, abs=1e-8)


def test_weights_of_another_features_version_are_refused(tmp_path):
    params, _ = network.load_weights(SHIPPED_WEIGHTS)
    path = tmp_path / "old.npz"
    np.savez(path, features_version=FEATURES_VERSION + 1,
             iterations=network.ITERATIONS, **params)
    with pytest.raises(ValueError, match=f"features version {FEATURES_VERSION + 1}.*"
                                         f"computes version {FEATURES_VERSION}.*retrain"):
        dqn(G.chain(10), 10**6, weights=path)


@pytest.mark.parametrize("name", sorted(RANDOM_GRAPHS))
def test_swaps_keep_the_host_peak_within_a_small_host_budget(name):
    graph = RANDOM_GRAPHS[name]()
    params, _ = network.load_weights(SHIPPED_WEIGHTS)
    # Budget 0: every walk goes to the last call, swapping all it wants.
    free = Agent(params).greedy(describe(graph), 0)
    unlimited = simulate(graph, free.plan).host_peak_bytes
    assert unlimited > 0, "the agent swaps nothing here: the test would prove nothing"
    host = unlimited // 3
    view = describe(graph, host_budget_bytes=host)
    walks = [Agent(params).greedy(view, 0)] + [
        Agent(params, seed=s).run_episode(view, 0, epsilon=1.0, learn=False)[0]
        for s in range(3)]  # random valid actions
    for walk in walks:
        assert simulate(graph, walk.plan).host_peak_bytes <= host
    if view.swap_bytes[view.can_swap].min() <= host:
        assert any(walk.plan.offloaded for walk in walks)
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + 0.6 * plain.activation_peak_bytes)
    plan = dqn_plan_or_none(graph, budget, offload=True, host_budget_bytes=host)
    if plan is None:
        return
    est = simulate(graph, plan)
    assert est.peak_bytes <= budget and est.host_peak_bytes <= host
    assert plan.settings["host_budget_bytes"] == host


def test_no_host_memory_means_no_swap_out():
    graph = G.resnet_like(4, bn_saved_mib=0.5)
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + 0.6 * plain.activation_peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = dqn(graph, budget, host_budget_bytes=0)
    assert plan.estimates.details["actions"]["swap"] == 0 and not plan.offloaded
    assert plan.peak_bytes <= budget


def test_a_zero_finetune_time_limit_stops_fine_tuning_with_a_warning():
    graph = G.resnet_like(3)
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + 0.6 * plain.activation_peak_bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stopped = dqn(graph, budget, finetune_episodes=1000, finetune_time_limit=0)
        shipped = dqn(graph, budget)
    assert any("Fine-tuning stopped at its time limit of 0 s after 0 of 1000 episodes"
               in str(w.message) for w in caught)
    assert stopped.estimates.details["finetune_episodes_run"] == 0
    assert stopped.estimates.note.startswith("Fine-tuning stopped")
    assert stopped.settings["finetune_time_limit"] == 0
    # No episode ran: the shipped weights plan.
    assert (stopped.segments, stopped.offloaded) == (shipped.segments, shipped.offloaded)


def test_fine_tuning_stops_at_the_first_episode_past_the_time_limit():
    view = describe(G.resnet_like(3))
    params, _ = network.load_weights(SHIPPED_WEIGHTS)
    agent = Agent(params, seed=0, batch_size=8)
    ran = []

    def slow(k, episode, losses):
        ran.append(k)
        time.sleep(0.05)  # every episode outlasts the limit

    agent.train([(view, 0)], 50, on_episode=slow, time_limit=0.01)
    assert ran == [0]


def test_fine_tuning_within_its_time_limit_runs_every_episode():
    graph = G.resnet_like(3)
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + 0.6 * plain.activation_peak_bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dqn(graph, budget, finetune_episodes=2, finetune_time_limit=3600)
    assert plan.estimates.details["finetune_episodes_run"] == 2
    assert not any("Fine-tuning stopped" in str(w.message) for w in caught)


@pytest.mark.parametrize("limit", [-1, "3", True])
def test_bad_finetune_time_limits_are_refused(limit):
    with pytest.raises(ValueError, match="finetune_time_limit must be None or a non-negative"):
        dqn(G.chain(10), 10**6, finetune_episodes=1, finetune_time_limit=limit)


@pytest.mark.parametrize("episodes", [-1, 1.5, True, "3"])
def test_bad_finetune_episodes_are_refused(episodes):
    with pytest.raises(ValueError, match="finetune_episodes must be a non-negative integer"):
        dqn(G.chain(10), 10**6, finetune_episodes=episodes)


def test_shipped_weights_are_small_package_data_with_their_version():
    assert pathlib.Path(SHIPPED_WEIGHTS).stat().st_size < 100_000
    assert "weights.npz" in (ROOT / "pyproject.toml").read_text()
    _, meta = network.load_weights(SHIPPED_WEIGHTS)
    assert meta["seed"] == 0 and meta["episodes"] > 0


def test_finetuning_changes_the_weights_deterministically():
    graph = G.resnet_like(3)
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + 0.6 * plain.activation_peak_bytes)
    view = describe(graph)
    params, _ = network.load_weights(SHIPPED_WEIGHTS)
    runs = []
    for _ in range(2):
        agent = Agent(params, seed=3, batch_size=8)
        agent.train([(view, budget)], 3)
        runs.append(agent.params)
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in network.NAMES)
    assert any(not np.array_equal(runs[0][k], params[k]) for k in network.NAMES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = dqn(graph, budget, finetune_episodes=3, seed=3)
    assert plan.settings["finetune_episodes"] == 3 and plan.peak_bytes <= budget


def test_tfremat_plan_forwards_finetune_episodes_to_dqn():
    import keras

    import tfremat

    inputs = keras.Input((64,))
    x = inputs
    for _ in range(6):
        x = keras.layers.Dense(256, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer="sgd", loss="mse")
    graph = tfremat.extract(model, batch_size=512)
    budget_mb = (simulate(graph).peak_bytes + min_feasible_budget(graph, "chen-sqrt")) / 2**21
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = tfremat.plan(model, budget_mb, graph=graph, planner="dqn",
                            finetune_episodes=3)
    assert plan.planner == "dqn" and plan.settings["finetune_episodes"] == 3
    assert plan.peak_bytes <= budget_mb * 2**20
    with pytest.raises(ValueError, match="finetune_episodes"):
        tfremat.plan(model, budget_mb, graph=graph, planner="dqn", finetune_episodes=-1)


@pytest.mark.slow
def test_training_script_reproduces_the_shipped_weights(tmp_path):
    # Holds on a CPU like the shipped run's; on an AMD EPYC and an Intel Xeon
    # reporting AVX512 the script trains other weights (docs/choosing-a-planner.md):
    # not resolved.
    out = tmp_path / "weights.npz"
    subprocess.run([sys.executable, "-m", "tfremat.planners.deepq.train", "--seed", "0",
                    "--out", str(out)], check=True, cwd=ROOT, timeout=3600)
    fresh, _ = network.load_weights(out)
    shipped, _ = network.load_weights(SHIPPED_WEIGHTS)
    for k in network.NAMES:
        np.testing.assert_array_equal(fresh[k], shipped[k])


@pytest.mark.parametrize("name", sorted(RANDOM_GRAPHS))
def test_without_offload_plans_are_recompute_only_or_autos_without_offload(name):
    graph = RANDOM_GRAPHS[name]()
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + 0.6 * plain.activation_peak_bytes)
    plan = dqn_plan_or_none(graph, budget, offload=False)
    if plan is None:
        return
    plan.validate(graph)
    assert not plan.offloaded and plan.settings["offload"] is False
    assert plan.estimates.details["actions"]["swap"] == 0
    assert simulate(graph, plan).peak_bytes <= budget
    if "fallback" in plan.estimates.details:
        auto = make_plan(graph, budget, "auto", offload=False)
        assert plan.segments == auto.segments
    # make_plan passes its offload setting on to the DQN.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert make_plan(graph, budget, "dqn", offload=False) == plan


def test_a_recompute_only_plan_of_the_agent_rewrites_with_the_originals_gradients():
    import keras

    import tfremat
    from tests.rewriter import rewrite_helpers as h

    keras.utils.set_random_seed(1)
    model = h.residual_cnn()
    x = h.batch_for(model)
    # The graph of the layers alone: at batch 2 the convolutions' gradients'
    # scratch (sized by the CPU's cache, not the batch) would be nearly all of
    # the peak, which no plan lowers.
    graph = tfremat.extract(model, batch_size=x.shape[0], measure_kernels=False)
    plain = simulate(graph)
    budget = int(plain.persistent_bytes + 0.97 * plain.activation_peak_bytes)
    # Five episodes of fine-tuning make the agent meet this budget itself (the
    # shipped weights alone fall back to auto on this small graph).
    plan = dqn(graph, budget, offload=False, finetune_episodes=5)
    assert "fallback" not in plan.estimates.details, plan.estimates.note
    assert plan.segments and not plan.offloaded and plan.peak_bytes <= budget
    rewritten = tfremat.rewrite(model, plan)
    assert rewritten is not model
    h.assert_same_step(model, rewritten, x)
    h.assert_same_step(model, rewritten, x, "function")
