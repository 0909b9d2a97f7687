"""The minimum a BudgetError states, planned for and measured, on `planners.py`'s models.

Issue #12 asks that `BudgetError`'s stated minimum be met when a plan is made for
that minimum, and that `auto` at its minimum never measure above chen-sqrt's
plan. This runs the user's way to the lowest peak, as `transformers.py` does for
the Transformers: ask `tfremat.plan(..., measure=True)` (what the `Planner`
callback does) for 1 MiB, read the minimum its BudgetError states (measured on
the device), then plan for that minimum, again with `measure=True`. Each
planning runs in a fresh process holding the model only, as a user's would.
The plan's steps are then measured in another fresh process (the allocator's
peak of each of `--repeats` steps, weights and batch included; the budget is
met when the largest is within it), beside chen-sqrt's plan at its own
minimum (predicted; `planners.py`'s row), measured the same way.

Usage:
    python benchmarks/stated_minimum.py [--models ResNet50,DenseNet121,VGG19] [--repeats 5]

Writes benchmarks/results/stated_minimum.md and stated_minimum.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planners import (MODELS, RESULTS, Runner, build_model,  # noqa: E402
                      compile_like_original, model_names, peak_in_fresh_process,
                      plan_at_minimum, plan_in_fresh_process, run_header)

MIB = 2**20


def plan_worker(name: str, budget_mib: float, plan_path: str) -> None:
    """Plans `name` for `budget_mib` with `measure=True` in this process; writes
    the plan to `plan_path` and prints `{}`, or prints the BudgetError as JSON."""
    import tfremat

    model, batch = build_model(name)
    try:
        plan = tfremat.plan(model, budget_mib, batch_size=batch, measure=True)
    except tfremat.BudgetError as e:
        print(json.dumps({"error": str(e), "min_budget_mb": e.min_budget_mb,
                          "measured": e.measured}))
        return
    plan.to_json(plan_path)
    print(json.dumps({}))


def fresh_plan(name: str, budget_mib: float) -> tuple[Any, dict[str, Any]]:
    """`plan_worker` in a fresh process: the plan, or None and the BudgetError."""
    return plan_in_fresh_process(__file__, name, budget_mib)


def peak_worker(name: str, plan_path: str, repeats: int) -> None:
    """Prints the peak of each of `repeats` steps of `name` rewritten with the
    plan at `plan_path`, in bytes."""
    from tfremat.api import rewrite
    from tfremat.core import Plan

    model, batch = build_model(name)
    model = rewrite(model, Plan.from_json(plan_path))
    compile_like_original(model)
    print(json.dumps(Runner(model, batch).step_peaks(repeats)))


def fresh_peaks(name: str, plan: Any, repeats: int) -> dict[str, float]:
    """The median and largest step peak of `name` under `plan`, in a fresh
    process, in MiB."""
    peaks = peak_in_fresh_process(__file__, ["--peak", name], plan, repeats)
    return {"measured_mib": statistics.median(peaks) / MIB, "max_mib": max(peaks) / MIB}


def run_model(name: str, repeats: int) -> dict[str, Any]:
    """The stated minimum of one model, its plan measured, and chen-sqrt's."""
    from tfremat.graph import extract

    model, batch = build_model(name)
    sqrt_plan = plan_at_minimum(extract(model, batch_size=batch), "chen-sqrt")
    record: dict[str, Any] = {
        "model": name, "batch": batch,
        "chen_sqrt": {"predicted_mib": sqrt_plan.peak_bytes / MIB,
                      **fresh_peaks(name, sqrt_plan, repeats)}}
    asked = fresh_plan(name, 1.0)[1]
    record["stated_mib"] = asked.get("min_budget_mb")
    record["stated_measured"] = asked.get("measured")
    if record["stated_mib"] is None:
        record["error"] = asked.get("error", "no BudgetError for 1 MiB")
        return record
    plan, error = fresh_plan(name, record["stated_mib"])
    if plan is None:
        record["error"] = error["error"]
        return record
    record["plan"] = {"planner": plan.planner, "segments": len(plan.segments),
                      "updates": plan.update_in_backward,
                      "predicted_mib": plan.peak_bytes / MIB,
                      "trials": plan.estimates.details.get("trials", []),
                      **fresh_peaks(name, plan, repeats)}
    print(f"  {name}: {json.dumps(record)}", flush=True)
    return record


def markdown(data: dict[str, Any]) -> str:
    lines = ["# The minimum a BudgetError states, planned for and measured", "",
             f"Command: `{data['command']}`", "",
             f"Machine: {data['machine']}. " + " ".join(
                 __doc__.split("\n\n")[1].split()), "",
             "| model | stated minimum MiB | plan at it: measured median (largest) MiB "
             "| predicted | planner, segments, updates | met (largest within) "
             "| chen-sqrt at its minimum: measured median (largest) | below chen-sqrt |",
             "|---|---:|---|---:|---|---|---|---|"]
    for r in data["records"]:
        sqrt = r["chen_sqrt"]
        sqrt_text = f"{sqrt['measured_mib']:.1f} ({sqrt['max_mib']:.1f})"
        if "plan" not in r:
            stated = f"{r['stated_mib']:.1f}" if r.get("stated_mib") else "-"
            error = " ".join(r.get("error", "").split())
            lines.append(f"| {r['model']} | {stated} | not planned: {error} | | | "
                         f"not met | {sqrt_text} | |")
            continue
        p = r["plan"]
        met = "met" if p["max_mib"] <= r["stated_mib"] else (
            f"missed by {p['max_mib'] - r['stated_mib']:.1f} MiB")
        below = (sqrt["measured_mib"] - p["measured_mib"]) / sqrt["measured_mib"]
        lines.append(
            f"| {r['model']} | {r['stated_mib']:.1f} | {p['measured_mib']:.1f} "
            f"({p['max_mib']:.1f}) | {p['predicted_mib']:.1f} | {p['planner']}, "
            f"{p['segments']}, {'yes' if p['updates'] else 'no'} | {met} | {sqrt_text} | "
            f"{below:+.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ResNet50,DenseNet121,VGG19",
                        help="Comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="Measured steps per plan.")
    parser.add_argument("--make-plan", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_plan:
        plan_worker(args.make_plan, args.budget, args.plan)
        return
    if args.peak:
        peak_worker(args.peak, args.plan, args.repeats)
        return
    data = run_header(__file__, args.repeats, 0)
    for name in model_names(parser, args.models, MODELS):
        print(f"{name}:", flush=True)
        data["records"].append(run_model(name, args.repeats))
        with open(os.path.join(RESULTS, "stated_minimum.json"), "w") as f:
            json.dump(data, f, indent=1)
        text = markdown(data)
        with open(os.path.join(RESULTS, "stated_minimum.md"), "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
