"""Repeatability: one plan measured in fresh processes, and what pinning the order costs.

Issue #12 asks that the same plan, measured in five fresh processes, spread by at
most 3% (plain and rewritten, ResNet50 and DenseNet121), and that the step-time
cost of pinning the backward order be stated. For each model of
`planners.py` (same sizes, SGD) this measures, each in `--runs` fresh
processes: the plain step, and chen-sqrt's plan at its minimum (the same
segments in every process: chen-sqrt is deterministic on one graph), on
TensorFlow's default inter-op threads (two here) unpinned and pinned (the plan
only), on one inter-op thread pinned (what `pin_order="auto"` does there), and the same with
Grappler's dependency optimizer off (a process-wide option that tfremat never
sets; the user can). The plain step has nothing to pin: its rows differ by
threads and that option only. Peaks: the allocator's peak
of one step, median of 3 steps after a warm-up, nothing else traced yet
(`planners.alone_peak_bytes`). Time, in each process measuring the plan: the
pinned and the unpinned step of the same plan alternately, median of `--steps`
each, as the ratio pinned / unpinned.

Usage:
    python benchmarks/repeatability.py [--models ResNet50,DenseNet121] [--runs 5]
        [--settings "1 thread, pinned"]

Writes benchmarks/results/repeatability.md and repeatability.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planners import RESULTS, model_names, run_header  # noqa: E402

MIB = 2**20
MODELS = ("ResNet50", "DenseNet121")
#: label -> (inter-op threads, pinned order, Grappler's dependency optimizer on)
SETTINGS = {"2 threads, free": (2, False, True), "2 threads, pinned": (2, True, True),
            "1 thread, pinned": (1, True, True),
            "1 thread, pinned, no dependency optimizer": (1, True, False)}
#: Settings whose plain step would repeat another's (the plain step is not rewritten).
PLAN_ONLY = ("2 threads, pinned",)


def worker(name: str, variant: str, setting: str, steps: int) -> dict[str, Any]:
    """One fresh process: the peak of `variant`, and for the plan the step-time
    ratio pinned / free."""
    import tensorflow as tf

    threads, pinned, dependency_optimizer = SETTINGS[setting]
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    if not dependency_optimizer:
        tf.config.optimizer.set_experimental_options({"dependency_optimization": False})
    from planners import (Runner, alone_peak_bytes, build_model, compile_like_original,
                          step_seconds)

    from tfremat.api import rewrite
    from tfremat.core import BudgetError
    from tfremat.graph import extract
    from tfremat.planners import make_plan

    model, batch = build_model(name)
    if variant == "plain":
        return {"peak_mib": alone_peak_bytes(model, batch, 3) / MIB}
    graph = extract(model, batch_size=batch)
    try:
        plan = make_plan(graph, 0, "chen-sqrt")
    except BudgetError as err:
        plan = make_plan(graph, err.min_budget_bytes, "chen-sqrt")

    def rewritten(pin: bool) -> Any:
        out = rewrite(model, dataclasses.replace(plan, pin_order=pin))
        compile_like_original(out)
        return out

    measured = rewritten(pinned)
    record = {"peak_mib": alone_peak_bytes(measured, batch, 3) / MIB,
              "predicted_mib": plan.peak_bytes / MIB, "segments": len(plan.segments)}
    other = rewritten(not pinned)
    seconds = step_seconds({"pinned": Runner(measured if pinned else other, batch),
                            "free": Runner(other if pinned else measured, batch)}, steps)
    record["pinned_over_free"] = seconds["pinned"] / seconds["free"]
    return record


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1


def markdown(data: dict[str, Any]) -> str:
    lines = ["# Repeatability: one plan in fresh processes, and the cost of pinning", "",
             "Commands: " + ", ".join(f"`{c}`" for c in dict.fromkeys(
                 r["command"] for r in data["rows"])), "",
             f"Machine: {data['machine']}. " + __doc__.split("\n\n")[1].replace("\n", " "),
             "", "| model | variant | threads, order | peaks by process (MiB) | spread "
             "(max/min - 1) | target | step time pinned / free, by process |",
             "|---|---|---|---|---:|---|---|"]
    for row in data["rows"]:
        peaks = [r["peak_mib"] for r in row["runs"]]
        ratios = [r["pinned_over_free"] for r in row["runs"] if "pinned_over_free" in r]
        lines.append(
            f"| {row['model']} | {row['variant']} | {row['setting']} | "
            + ", ".join(f"{p:.1f}" for p in peaks)
            + f" | {spread(peaks):.1%} | {'met' if spread(peaks) <= 0.03 else 'missed'} (3%) | "
            + (", ".join(f"{r:.2f}x" for r in ratios) if ratios else "") + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--settings", default=";".join(SETTINGS),
                        help="Semicolon-separated subset of: " + "; ".join(SETTINGS)
                        + ". Rows of other settings and models are kept from the last run.")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps)))
        return
    settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    if any(s not in SETTINGS for s in settings):
        parser.error(f"--settings: choose from {list(SETTINGS)}")
    names = model_names(parser, args.models, MODELS)
    path = os.path.join(RESULTS, "repeatability.json")
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            kept = [r for r in json.load(f)["rows"]
                    if r["setting"] not in settings or r["model"] not in names]
    data = run_header(__file__, args.runs, args.steps)
    data["command"] = shlex.join(["python", "benchmarks/repeatability.py", *sys.argv[1:]])
    data["rows"] = kept
    for name in names:
        for variant in ("plain", "plan"):
            for setting in settings:
                if variant == "plain" and setting in PLAN_ONLY:
                    continue
                row = {"model": name, "variant": variant, "setting": setting, "runs": [],
                       "command": data["command"]}
                for _ in range(args.runs):
                    out = subprocess.run(
                        [sys.executable, __file__, "--steps", str(args.steps), "--worker",
                         name, variant, setting],
                        check=True, capture_output=True, text=True).stdout
                    row["runs"].append(json.loads(out.strip().splitlines()[-1]))
                    print(name, variant, setting, row["runs"][-1], flush=True)
                data["rows"].append(row)
                with open(path, "w") as f:
                    json.dump(data, f, indent=1)
    order = {(m, v, s): i for i, (m, v, s) in enumerate(
        (m, v, s) for m in MODELS for v in ("plain", "plan") for s in SETTINGS)}
    data["rows"].sort(key=lambda r: order[(r["model"], r["variant"], r["setting"])])
    text = markdown(data)
    with open(os.path.join(RESULTS, "repeatability.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
