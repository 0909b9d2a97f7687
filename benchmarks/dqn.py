"""The DQN planner beside swap, auto and chen-sqrt: simulated peak vs overhead.

For ResNet50, VGG19, a U-Net, a Transformer encoder and a stacked LSTM,
budgets at 1.25x ... 3x less activation memory (peak minus weights, optimizer
state and batch) are planned by:

- dqn: `planner="dqn"` with the shipped weights (the agent's own plan; when it
  misses the budget, the planner falls back to auto, and the row says "miss");
- dqn fine-tuned: the same after `FINETUNE_EPISODES` episodes on the graph
  and budget;
- swap: offload only (`swap` on no plan);
- auto: `make_plan(..., offload=True)`: the DP and Chen planners, then offload
  on top of recompute plans;
- chen-sqrt: sqrt(n) segments, one plan whatever the budget.

Everything is simulated as in benchmarks/offload.py: FLOPs-based compute at
5e12 FLOP/s and two copy streams of 16 GB/s. Writes benchmarks/results/dqn.md,
dqn.json and the Pareto plot dqn.png.

    python benchmarks/dqn.py --cache /tmp/graphs    # reuse extracted graphs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any, Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# NumPy's BLAS on one thread: the DQN's small matrices ran ~5x slower with two
# threads fighting over 2 cores (set before NumPy loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REDUCTIONS = (1.25, 1.5, 2.0, 2.5, 3.0)
FINETUNE_EPISODES = 20
ROWS = ("dqn", "dqn fine-tuned", "swap", "auto", "chen-sqrt")
MIB = 2**20


def lstm(layers: int = 4, seq: int = 256, width: int = 512, vocab: int = 8000) -> Any:
    """Stacked LSTMs over token embeddings, a softmax over the vocabulary per step."""
    import keras

    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, width)(tokens)
    for _ in range(layers):
        x = keras.layers.LSTM(width, return_sequences=True)(x)
    model = keras.Model(tokens, keras.layers.Dense(vocab)(x), name="lstm")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def unet() -> Any:
    """benchmarks/planners.py's U-Net at 256 px."""
    sys.path.insert(0, HERE)
    import planners

    model = planners.build_unet(256)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def models() -> list[tuple[str, Callable[[], Any], int]]:
    """(label, builder, batch size) of each model."""
    sys.path.insert(0, HERE)
    import offload

    return [("ResNet50 224px", offload.application("ResNet50"), 32),
            ("VGG19 224px", offload.application("VGG19"), 32),
            ("UNet 256px", unet, 8),
            ("Transformer encoder 8x512, seq 512", offload.transformer_encoder, 8),
            ("LSTM 4x512, seq 256", lstm, 16)]


def run_row(graph: Any, budget: int, row: str) -> dict[str, Any]:
    """Plans `graph` under `budget` the way `row` names; figures of the plan."""
    from tfremat.core import BudgetError
    from tfremat.planners import chen_sqrt, dqn, make_plan, swap
    from tfremat.simulation import simulate

    makers = {
        "dqn": lambda: dqn(graph, budget),
        "dqn fine-tuned": lambda: dqn(graph, budget, finetune_episodes=FINETUNE_EPISODES),
        "swap": lambda: swap(graph, budget),
        "auto": lambda: make_plan(graph, budget, offload=True),
        "chen-sqrt": lambda: chen_sqrt(graph),
    }
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = makers[row]()
    except BudgetError as err:
        return {"met": False, "seconds": time.perf_counter() - started,
                "peak": err.min_budget_bytes, "overhead": None}
    seconds = time.perf_counter() - started
    details = plan.estimates.details
    if "fallback" in details:  # the agent's own plan missed: report it
        return {"met": False, "seconds": seconds, "peak": details["agent_peak_bytes"],
                "overhead": details["agent_overhead"], "actions": details["actions"]}
    est = simulate(graph, plan)
    return {"met": est.peak_bytes <= budget, "seconds": seconds, "peak": est.peak_bytes,
            "overhead": est.step_seconds / est.baseline_seconds - 1,
            "segments": len(plan.segments), "offloaded": len(plan.offloaded),
            **({"actions": details["actions"]} if "actions" in details else {})}


def sweep(label: str, graph: Any) -> dict[str, Any]:
    """Every row at every budget of `REDUCTIONS`."""
    from tfremat.simulation import simulate

    plain = simulate(graph)
    activations = plain.peak_bytes - plain.persistent_bytes
    budgets = []
    for r in REDUCTIONS:
        budget = round(plain.persistent_bytes + activations / r)
        cells = {}
        for row in ROWS:
            cells[row] = run_row(graph, budget, row)
            cells[row]["reduction"] = activations / max(
                cells[row]["peak"] - plain.persistent_bytes, 1)
        budgets.append({"target": r, "budget": budget, "rows": cells})
        print(f"{label} {r}x: " + ", ".join(
            f"{row} {'met' if c['met'] else 'miss'} {c['seconds']:.1f}s"
            for row, c in cells.items()), flush=True)
    return {"model": label, "nodes": len(graph), "peak": plain.peak_bytes,
            "persistent": plain.persistent_bytes, "activations": activations,
            "step_seconds": plain.step_seconds, "budgets": budgets}


def cell(c: dict[str, Any]) -> str:
    if c["overhead"] is None:
        return f"miss (lowest {c['peak'] / MIB:.0f} MiB)"
    text = f"{c['peak'] / MIB:.0f} MiB, +{c['overhead']:.1%}, {c['seconds']:.1f} s"
    return text if c["met"] else f"miss: {text}"


def summary(results: list[dict[str, Any]]) -> list[str]:
    """Per row: budgets met, lowest overhead among the rows that met, times."""
    lines = ["| planner | budgets met | lowest overhead of all (of budgets some planner met) "
             "| median planning s | max planning s |", "|---|---:|---:|---:|---:|"]
    cells = [b["rows"] for m in results for b in m["budgets"]]
    some = [c for c in cells if any(x["met"] for x in c.values())]
    for row in ROWS:
        met = sum(c[row]["met"] for c in cells)
        best = sum(c[row]["met"] and c[row]["overhead"] <= min(
            x["overhead"] for x in c.values() if x["met"]) + 1e-9 for c in some)
        times = sorted(c[row]["seconds"] for c in cells)
        lines.append(f"| {row} | {met}/{len(cells)} | {best}/{len(some)} "
                     f"| {times[len(times) // 2]:.1f} | {times[-1]:.1f} |")
    return lines


def report(results: list[dict[str, Any]], weights_meta: dict[str, Any]) -> str:
    lines = [
        "# The DQN planner: simulated device peak vs step-time overhead",
        "",
        "`python benchmarks/dqn.py` — all figures SIMULATED by `tfremat.simulate` as in "
        "`benchmarks/offload.py`: compute time is FLOPs / 5e12 FLOP/s, copies on two "
        "streams of 16 GB/s overlapping compute. Adam, keras.applications with "
        "weights=None. Budgets remove 1.25x ... 3x of the activation memory (peak minus "
        "weights, optimizer state and batch). Overhead = simulated step time / step time "
        "without a plan - 1 (recomputation plus stalls). Each cell: simulated peak, "
        "overhead, planning time; \"miss\" = over the budget (for dqn, the agent's own "
        "plan: the planner then falls back to `auto`).",
        "",
        f"Shipped weights: {weights_meta}. Fine-tuning: {FINETUNE_EPISODES} episodes on the "
        "graph and budget.",
        "",
    ] + summary(results) + [""]
    for m in results:
        lines += [f"## {m['model']}", "",
                  f"{m['nodes']} layer calls; peak without a plan {m['peak'] / MIB:.0f} MiB = "
                  f"{m['persistent'] / MIB:.0f} MiB persistent + "
                  f"{m['activations'] / MIB:.0f} MiB activations; simulated step "
                  f"{m['step_seconds'] * 1e3:.1f} ms.", "",
                  "| target | budget MiB | " + " | ".join(ROWS) + " |",
                  "|---:|---:|" + "---|" * len(ROWS)]
        for b in m["budgets"]:
            lines.append(f"| {b['target']:g}x | {b['budget'] / MIB:.0f} | "
                         + " | ".join(cell(b["rows"][r]) for r in ROWS) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8),
                             squeeze=False)
    styles = dict(zip(ROWS, ("o-", "D--", "s-", "^-", "v:")))
    for ax, m in zip(axes[0], results):
        for row in ROWS:
            points = sorted((b["rows"][row]["reduction"], 100 * b["rows"][row]["overhead"])
                            for b in m["budgets"] if b["rows"][row]["met"])
            if points:
                ax.plot(*zip(*points), styles[row], label=row, alpha=0.8)
        ax.set_title(m["model"], fontsize=9)
        ax.set_xlabel("activation memory reduction (x)")
        ax.set_ylabel("simulated overhead (%)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", help="directory to keep extracted PlanGraphs in")
    parser.add_argument("--models", help="comma-separated first words of the labels")
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    import offload

    from tfremat.planners.deepq import SHIPPED_WEIGHTS
    from tfremat.planners.deepq.network import load_weights

    wanted = set(args.models.split(",")) if args.models else None
    results = []
    for label, build, batch in models():
        if wanted and label.split()[0] not in wanted:
            continue
        graph = offload.load_graph(label, build, batch, args.cache)
        results.append(sweep(label, graph))
    _, meta = load_weights(SHIPPED_WEIGHTS)
    text = report(results, meta)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "dqn.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(RESULTS, "dqn.json"), "w") as f:
        json.dump({"finetune_episodes": FINETUNE_EPISODES, "weights": meta,
                   "models": results}, f, indent=1)
    plot(results, os.path.join(RESULTS, "dqn.png"))


if __name__ == "__main__":
    main()
