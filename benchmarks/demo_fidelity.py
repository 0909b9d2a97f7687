"""Predicted vs measured peaks of the demo's model, with the bytes held beside it.

`tfremat demo` feeds its model from a `tf.data` pipeline made from NumPy arrays
(12 MiB of images). On a CPU the allocator may hold those arrays beside the
model, and a measured peak counts them, while the simulator predicts the model's
step alone. For each variant, in fresh processes (`--runs`, 3 by default), this
extracts the demo's graph as the demo does (from its dataset), plans, rewrites,
and measures with `measure_peak(sample=dataset, repeats=5)`. The held bytes are
the bytes in use before the measured step less the graph's persistent bytes
(weights, optimizer slots, batch): what `measured_choice` records as
`held_bytes`. Prints a markdown table and writes
benchmarks/results/demo_fidelity.md.

    python benchmarks/demo_fidelity.py
    python benchmarks/demo_fidelity.py --runs 5 plain chen-greedy:190

A variant is `plain` or `planner:budget_mib` (a plan of that planner for that
budget); the defaults are the two plans the demo measured on 2026-12-07.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Iterable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planners import json_from_process, machine  # noqa: E402

VARIANTS = ["plain", "approx-dp:241", "chen-greedy:190"]
MIB = 2**20


def measure_one(variant: str) -> dict:
    import keras

    import tfremat
    from tfremat.api import held_bytes
    from tfremat.demo import _compiled, _data

    model = _compiled(seed=1)
    data = _data(32, 8)
    graph = tfremat.extract(model, sample=data)
    if variant == "plain":
        plan = tfremat.Plan.from_segments(graph, [])
        plan.graph = graph
    else:
        planner, budget = variant.split(":")
        plan = tfremat.plan(model, float(budget), graph=graph, planner=planner)
        model = tfremat.rewrite(model, plan)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
    measured = tfremat.measure_peak(model, sample=data, repeats=5, return_details=True)
    return {"variant": variant, "segments": len(plan.segments),
            "predicted_mb": tfremat.simulate(graph, plan).peak_mb,
            "measured_mb": measured.peak_mb, "held_mb": held_bytes(measured, plan) / MIB,
            "device": measured.device}


def run_one(variant: str) -> dict:
    """`measure_one(variant)` in a fresh process."""
    return json_from_process([__file__, "--one", variant],
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})


def listed(values: Iterable[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def span(values: list[float], form: str = "{:.1f}") -> str:
    low, high = min(values), max(values)
    return form.format(low) if low == high else f"{form.format(low)} to {form.format(high)}"


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--one":
        print(json.dumps(measure_one(argv[1])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help="plain or planner:budget_mib")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per variant")
    args = parser.parse_args(argv)
    variants = args.variants or VARIANTS
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(args.runs):  # round-robin, as simulator_fidelity.py
        for variant in variants:
            runs[variant].append(run_one(variant))
            print(f"done {variant} ({i + 1}/{args.runs})", file=sys.stderr)
    lines = [
        "# The demo's model: predicted vs measured, with the bytes held beside it",
        "",
        f"`python benchmarks/demo_fidelity.py` on {machine()}, device "
        f"{runs[variants[0]][0]['device']}; {args.runs} fresh processes per variant. "
        "Measured: `measure_peak(sample=dataset, repeats=5)`, the largest of five steps. "
        "Held: in use before the step beyond the graph's weights and batch (the "
        "dataset's arrays, when the allocator holds them). Step: measured less held. "
        "Error: predicted against each step measured.",
        "",
        "| variant | segments | predicted MiB | measured MiB | held MiB | step MiB | error |",
        "|---|---:|---:|---|---|---|---|",
    ]
    for variant in variants:
        rs = runs[variant]
        steps = [r["measured_mb"] - r["held_mb"] for r in rs]
        predicted = statistics.median(r["predicted_mb"] for r in rs)
        lines.append(
            f"| {variant} | {rs[0]['segments']} | {predicted:.1f} "
            f"| {listed(r['measured_mb'] for r in rs)} "
            f"| {listed(r['held_mb'] for r in rs)} | {span(steps)} "
            f"| {span([predicted / s - 1 for s in steps], '{:+.1%}')} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(os.path.dirname(__file__), "results", "demo_fidelity.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
