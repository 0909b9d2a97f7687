"""Simulated device peak vs step-time overhead: recompute, offload, and both.

For ResNet50, VGG19 and a transformer encoder, budgets at 1.25x ... 6x less
activation memory (peak minus weights, optimizer state and batch) are planned
three ways:

- recompute only: `make_plan(..., offload=False)` ("auto" without offload);
- offload only: `swap` on no plan;
- combined: the cheapest of the recompute plan and `swap_combined` on top of
  every recompute plan of the sweep (recompute then offload the overflow, or
  offload where cheaper).

Everything is simulated: FLOPs-based compute at a device rate (default 5e12
FLOP/s) and two copy streams of 16 GB/s each. Prints a markdown table, writes
benchmarks/results/offload.md and a Pareto plot benchmarks/results/offload.png.

    python benchmarks/offload.py
    python benchmarks/offload.py --bandwidth 32 --device-flops 1e13
    python benchmarks/offload.py --cache /tmp/graphs    # reuse extracted graphs
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REDUCTIONS = (1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0)
GOAL_REDUCTION, GOAL_OVERHEAD = 4.0, 0.20
MIB = 2**20


def transformer_encoder(blocks: int = 8, seq: int = 512, width: int = 512, heads: int = 8,
                        ff: int = 2048, vocab: int = 8000):
    import keras

    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, width)(tokens)
    for _ in range(blocks):
        h = keras.layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, h]))
        h = keras.layers.Dense(ff, activation="relu")(x)
        h = keras.layers.Dense(width)(h)
        x = keras.layers.LayerNormalization()(keras.layers.Add()([x, h]))
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(tokens, keras.layers.Dense(10)(x), name="transformer_encoder")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def application(name: str) -> Callable:
    def build():
        import keras

        model = getattr(keras.applications, name)(weights=None, input_shape=(224, 224, 3))
        model.compile(optimizer="adam", loss="categorical_crossentropy")
        return model
    return build


#: (label, model builder, batch size)
MODELS = [
    ("ResNet50 224px", application("ResNet50"), 32),
    ("VGG19 224px", application("VGG19"), 32),
    ("Transformer encoder 8x512, seq 512", transformer_encoder, 8),
]


def load_graph(label: str, build: Callable, batch: int, cache: str | None):
    """Extracts the model's PlanGraph (TensorFlow), or reads it from `cache`."""
    from tfremat import PlanGraph

    path = None
    if cache:
        os.makedirs(cache, exist_ok=True)
        path = os.path.join(cache, f"{label.split()[0]}_{batch}.json")
        if os.path.exists(path):
            return PlanGraph.from_json(path)
    import tfremat

    graph = tfremat.extract(build(), batch_size=batch)
    if path:
        graph.to_json(path)
    return graph


def sweep(graph, bandwidth: float, device_flops: float) -> dict:
    """Plans every budget of `REDUCTIONS` three ways.

    Returns:
        `"plain"` (the Estimate without a plan), `"activations"` (its peak above
        the persistent bytes), `"limits"` (see `limits`) and `"rows"`, one per
        budget.
    """
    from tfremat.core import BudgetError
    from tfremat.planners import make_plan, swap, swap_combined
    from tfremat.simulation import simulate

    timing = {"bandwidth_gbps": bandwidth, "device_flops": device_flops}
    plain = simulate(graph, **timing)
    persistent = plain.persistent_bytes
    activations = plain.peak_bytes - persistent
    budgets = [round(persistent + activations / r) for r in REDUCTIONS]

    def attempt(make: Callable[[], object]):
        try:
            plan = make()
        except BudgetError:
            return None
        est = simulate(graph, plan, **timing)
        return {"plan": plan, "peak": est.peak_bytes, "host": est.host_peak_bytes,
                "reduction": activations / max(est.peak_bytes - persistent, 1),
                "overhead": est.step_seconds / est.baseline_seconds - 1}

    recompute = [attempt(lambda b=b: make_plan(graph, b, offload=False)) for b in budgets]
    bases = list({repr(r["plan"].segments): r["plan"] for r in recompute if r}.values())
    rows = []
    for r, budget, rec in zip(REDUCTIONS, budgets, recompute):
        offload = attempt(lambda: swap(graph, budget, **timing))
        both = attempt(lambda: swap_combined(graph, budget, bases, **timing))
        if rec and (both is None or rec["overhead"] <= both["overhead"]):
            both = rec
        rows.append({"target": r, "budget": budget, "recompute": rec, "offload": offload,
                     "combined": both})
    return {"plain": plain, "activations": activations, "limits": limits(graph, timing),
            "rows": rows}


def limits(graph, timing: dict) -> dict:
    """What bounds the reduction: the copy capacity of the forward pass, and
    the lowest peak any plan reaches ("auto" with offload) with its make-up."""
    from tfremat.planners import make_plan, min_feasible_budget
    from tfremat.simulation import build_schedule, simulate

    plain = simulate(graph, **timing)
    labels = [label for label, _ in plain.timeline]
    forward_seconds = plain.step_times[labels.index("loss")][0]
    floor = min_feasible_budget(graph, **timing)
    plan = make_plan(graph, floor, **timing)
    est = simulate(graph, plan, **timing)
    peak_at = [label for label, _ in est.timeline].index(est.peak_step)
    schedule = build_schedule(graph, plan, device_flops=timing["device_flops"])
    wgrads = sum(schedule.size[key] for key in schedule.weight_grads
                 if schedule.alloc_step[key] <= peak_at)
    return {"copy_capacity": timing["bandwidth_gbps"] * 1e9 * forward_seconds,
            "forward_seconds": forward_seconds, "floor": est.peak_bytes,
            "floor_step": est.peak_step, "floor_planner": plan.planner,
            "weight_grads": wgrads, "workspace": schedule.transient[peak_at]}


def cell(result: dict | None) -> str:
    if result is None:
        return "—"
    plan = result["plan"]
    return (f"{result['peak'] / MIB:.0f} MiB, {result['reduction']:.2f}x, "
            f"+{result['overhead']:.1%} ({len(plan.segments)} seg, {len(plan.offloaded)} off)")


def best_within(rows: list[dict], mode: str) -> float:
    """The largest activation reduction with at most the goal's overhead."""
    found = [row[mode]["reduction"] for row in rows
             if row[mode] and row[mode]["overhead"] <= GOAL_OVERHEAD]
    return max(found, default=1.0)


def report(results: list[tuple[str, int, object, dict]], bandwidth: float,
           device_flops: float) -> str:
    lines = [
        "# Host offload: simulated device peak vs step-time overhead",
        "",
        f"`python benchmarks/offload.py` — all figures SIMULATED by `tfremat.simulate`: "
        f"compute time is FLOPs / {device_flops:.1e} FLOP/s (an assumed GPU-like device "
        f"rate: the overheads scale with it), copies on two independent streams of "
        f"{bandwidth:g} GB/s each (device to host, host to device), overlapping compute. "
        "Adam, keras.applications with weights=None. Reduction = activation memory "
        "(peak minus weights, optimizer state and batch) without a plan / with it. "
        "Overhead = simulated step time / step time without a plan - 1 (recomputation "
        "plus stalls waiting for copies). Each cell: peak, reduction, overhead "
        "(recompute segments, offloaded tensors).",
        "",
        f"Goal: >= {GOAL_REDUCTION:g}x activation reduction at <= {GOAL_OVERHEAD:.0%} "
        "overhead.",
        "",
    ]
    summary = ["| model | nodes | activations MiB | step ms | best reduction at <= 20%: "
               "recompute | offload | combined | goal met |",
               "|---|---:|---:|---:|---:|---:|---:|---|"]
    for label, batch, graph, head in results:
        rows = head["rows"]
        best = {m: best_within(rows, m) for m in ("recompute", "offload", "combined")}
        summary.append(
            f"| {label}, batch {batch} | {len(graph)} | {head['activations'] / MIB:.0f} "
            f"| {head['plain'].step_seconds * 1e3:.0f} | {best['recompute']:.2f}x "
            f"| {best['offload']:.2f}x | {best['combined']:.2f}x "
            f"| {'yes' if best['combined'] >= GOAL_REDUCTION else 'no'} |")
    lines += summary + [""]
    for label, batch, graph, head in results:
        rows = head["rows"]
        plain, lim = head["plain"], head["limits"]
        floor_activations = lim["floor"] - plain.persistent_bytes
        other = floor_activations - lim["weight_grads"] - lim["workspace"]
        lines += [
            f"## {label}, batch {batch}",
            "",
            f"{len(graph)} layer calls; peak without a plan {plain.peak_bytes / MIB:.0f} MiB "
            f"= {plain.persistent_bytes / MIB:.0f} MiB persistent + "
            f"{head['activations'] / MIB:.0f} MiB activations; simulated step "
            f"{plain.step_seconds * 1e3:.1f} ms.",
            "",
            f"Limits: the forward pass lasts {lim['forward_seconds'] * 1e3:.1f} ms, so one "
            f"{bandwidth:g} GB/s stream can move at most {lim['copy_capacity'] / MIB:.0f} MiB "
            "to the host before the backward pass starts (a copy in flight holds its device "
            "buffer). The lowest peak any plan reaches is "
            f"{lim['floor'] / MIB:.0f} MiB ({head['activations'] / floor_activations:.2f}x, "
            f"planner {lim['floor_planner']!r}), at step `{lim['floor_step']}`: "
            f"{plain.persistent_bytes / MIB:.0f} MiB persistent, "
            f"{lim['weight_grads'] / MIB:.0f} MiB weight gradients held for the optimizer, "
            f"{lim['workspace'] / MIB:.0f} MiB workspace of the step, and "
            f"{other / MIB:.0f} MiB of other live tensors (what the step reads and writes, partial "
            "gradients, tensors kept for later steps).",
            "",
            "| target | budget MiB | recompute only | offload only | combined | "
            "host MiB (combined) |",
            "|---:|---:|---|---|---|---:|",
        ]
        for row in rows:
            host = row["combined"]["host"] / MIB if row["combined"] else 0.0
            lines.append(
                f"| {row['target']:g}x | {row['budget'] / MIB:.0f} | {cell(row['recompute'])} "
                f"| {cell(row['offload'])} | {cell(row['combined'])} | {host:.0f} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[tuple[str, int, object, dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    styles = {"recompute": "o-", "offload": "s-", "combined": "^-"}
    for ax, (label, batch, _, head) in zip(axes[0], results):
        for mode, style in styles.items():
            points = sorted((row[mode]["reduction"], 100 * row[mode]["overhead"])
                            for row in head["rows"] if row[mode])
            if points:
                ax.plot(*zip(*points), style, label=mode)
        right = max(GOAL_REDUCTION + 1, ax.get_xlim()[1])
        ax.fill_between([GOAL_REDUCTION, right], 0, 100 * GOAL_OVERHEAD,
                        color="green", alpha=0.12, label="goal")
        ax.set_xlim(1, right)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{label}, batch {batch}", fontsize=9)
        ax.set_xlabel("activation memory reduction (x)")
        ax.set_ylabel("simulated overhead (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", type=float, default=16.0, help="GB/s per copy stream")
    parser.add_argument("--device-flops", type=float, default=5e12, help="FLOP/s")
    parser.add_argument("--cache", help="directory to keep extracted PlanGraphs in")
    args = parser.parse_args()
    results = []
    for label, build, batch in MODELS:
        graph = load_graph(label, build, batch, args.cache)
        started = time.perf_counter()
        head = sweep(graph, args.bandwidth, args.device_flops)
        print(f"{label}: planned in {time.perf_counter() - started:.0f} s", flush=True)
        results.append((label, batch, graph, head))
    text = report(results, args.bandwidth, args.device_flops)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "offload.md"), "w") as f:
        f.write(text + "\n")
    plot(results, os.path.join(RESULTS, "offload.png"))


if __name__ == "__main__":
    main()
