"""Trains the DQN planner's weights from a seed (they ship as `weights.npz`).

    python -m tfremat.planners.deepq.train --seed 0

reproduces the shipped weights: the same seed draws the same synthetic graphs
(`synthetic.random_graph`: chains, residual, U-Net and Transformer-like DAGs of
12 to 60 calls), the same budget for each episode (`synthetic.random_budget`),
the same exploration and the same replay samples, so the same weights come out
(NumPy only). The script runs NumPy's BLAS on one thread (it restarts itself
with `OMP_NUM_THREADS=1`): on these small matrices, BLAS threads fighting over
2 cores made each forward pass about 5 times slower. The shipped run took 798 s on this
project's 2-core machine while other tests ran beside it; a second run gave the
same weights, bit for bit, in 715 s. On another CPU (an AMD EPYC reporting AVX512)
it trains other weights, the same from run to run (docs/choosing-a-planner.md).
It prints the mean
loss every 100 episodes and, at the end, how many held-out graphs and budgets
the greedy policy meets (27 of 40 for the shipped weights; random weights met
0 to 18).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from tfremat.planners.deepq import network, synthetic
from tfremat.planners.deepq.agent import Agent, Task
from tfremat.planners.deepq.features import FEATURES_VERSION, describe
from tfremat.planners.deepq.planner import SHIPPED_WEIGHTS

#: Episodes of the shipped weights' run.
EPISODES = 1500

#: Synthetic graphs the episodes draw from.
GRAPHS = 80


def train(seed: int = 0, episodes: int = EPISODES, graphs: int = GRAPHS,
          verbose: bool = True) -> tuple[network.Params, list[float]]:
    """Trains weights from random ones on synthetic graphs.

    Args:
        seed: Seed of the graphs, the budgets, the initial weights and the agent.
        episodes: Episodes of Algorithm 1.
        graphs: Synthetic graphs drawn once; each episode picks one of them
            and a fresh budget.
        verbose: Print progress.

    Returns:
        `(weights, losses of every update)`.
    """
    rng = np.random.default_rng(seed)
    views = [describe(synthetic.random_graph(rng)) for _ in range(graphs)]

    def task(agent_rng: np.random.Generator) -> Task:
        view = views[int(agent_rng.integers(len(views)))]
        return view, synthetic.random_budget(agent_rng, view.graph)

    agent = Agent(network.init_params(rng), seed=seed)
    started = time.perf_counter()
    window: list[float] = []

    def report(k: int, _episode: object, losses: list[float]) -> None:
        window.extend(losses)
        if verbose and (k + 1) % 100 == 0:
            print(f"episode {k + 1}/{episodes}: mean loss {np.mean(window):.4f}, "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
            window.clear()

    losses = agent.train(task, episodes, on_episode=report)
    return agent.params, losses


def evaluate(params: network.Params, seed: int, count: int = 40) -> tuple[int, int]:
    """How many held-out synthetic graphs and budgets the greedy policy meets.

    Returns:
        `(met, count)`.
    """
    rng = np.random.default_rng(10_000 + seed)
    agent = Agent(params, seed=seed)
    met = 0
    for _ in range(count):
        graph = synthetic.random_graph(rng)
        budget = synthetic.random_budget(rng, graph)
        met += agent.greedy(describe(graph), budget).estimate.peak_bytes <= budget
    return met, count


def main() -> None:
    if os.environ.get("OMP_NUM_THREADS") != "1":
        os.environ["OMP_NUM_THREADS"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=EPISODES)
    parser.add_argument("--graphs", type=int, default=GRAPHS)
    parser.add_argument("--out", default=SHIPPED_WEIGHTS, help="where to write the weights")
    args = parser.parse_args()
    started = time.perf_counter()
    params, losses = train(args.seed, args.episodes, args.graphs)
    seconds = time.perf_counter() - started
    network.save_weights(args.out, params, seed=args.seed, episodes=args.episodes,
                         graphs=args.graphs, updates=len(losses))
    met, count = evaluate(params, args.seed)
    print(f"features version {FEATURES_VERSION}, {len(losses)} updates in {seconds:.0f} s; "
          f"held-out budgets met {met}/{count}; wrote {args.out}")


if __name__ == "__main__":
    main()
