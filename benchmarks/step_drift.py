"""What the allocator holds before each step, over a process's first steps.

The simulator starts a step from the persistent bytes (weights, optimizer
slots, the batch) placed in chunks of their own size. A real process holds more
before each step, and more as steps go on: an SGD update (`AssignSubVariableOp`)
whose variable is still read by the forward pass's read of it copies the
variable into a new buffer, which the allocator places in a free chunk of up to
twice its size (docs/how-it-works.md, "The update copies the variable"). With
updates in the backward pass, or the order pinned, the update waits for the
unit's input gradients, and copies nothing.

For each model of `planners.py` named (same sizes, SGD) and each variant (the
plain step; a row of `planners.PLANNERS` planned at its minimum budget; that plan
with its backward order pinned, `Plan.pin_order`, when the variant ends in
" (pinned)"), the plan is made in a process of its own (which extracts the
graph and records the simulator's persistent bytes and predicted peak), then
measured in a fresh
process holding the model only: the bytes in use once the model is built
(against its variables' bytes), once the batch is made, and after each of
`--steps` steps, with each step's peak and the peak less the bytes in use
before it (the step's own bytes, which the simulator predicts as its peak less
its persistent bytes).

Usage:
    python benchmarks/step_drift.py [--models ResNet152]
        [--variants "plain,chen-greedy,chen-greedy (pinned)"] [--steps 6]
        [--output step_drift]

Writes benchmarks/results/step_drift.md and step_drift.json (`--output`
names them otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planners import (MIB, MODELS, PLANNERS, RESULTS, build_model,  # noqa: E402
                      compile_like_original, json_from_process, model_names,
                      plan_at_minimum, run_header, synthetic_xy)

DEFAULT_VARIANTS = "plain,chen-sqrt,chen-sqrt (pinned),chen-sqrt + updates"
PINNED = " (pinned)"


def plan_worker(name: str, variant: str, path: str) -> None:
    """Extracts `name`'s graph, plans `variant` at its minimum (none for
    "plain"; pinned for a variant ending in `PINNED`) and writes the plan to
    `path`; prints the simulator's figures."""
    from tfremat.graph import extract
    from tfremat.simulation import simulate

    model, batch = build_model(name)
    graph = extract(model, batch_size=batch)
    row = variant.removesuffix(PINNED)
    plan = None if row == "plain" else plan_at_minimum(graph, row)
    if plan is not None and variant.endswith(PINNED):
        plan = dataclasses.replace(plan, pin_order=True)
    if plan is not None:
        plan.to_json(path)
    estimate = simulate(graph, plan)
    print(json.dumps({"predicted_mib": estimate.peak_bytes / MIB,
                      "persistent_mib": estimate.persistent_bytes / MIB,
                      "segments": len(plan.segments) if plan is not None else 0,
                      "updates": bool(plan is not None and plan.update_in_backward)}))


def measure_worker(name: str, path: str, steps: int) -> None:
    """Builds `name` (rewritten with the plan at `path`, if any), then prints
    the bytes in use after building, after making the batch and after each of
    `steps` steps, and each step's peak, in MiB."""
    import tensorflow as tf

    from tfremat.api import rewrite
    from tfremat.backend import device_name
    from tfremat.core import Plan
    from tfremat.graph import step_function

    device = device_name()

    def in_use() -> float:
        return tf.config.experimental.get_memory_info(device)["current"] / MIB

    model, batch = build_model(name)
    variables_mib = sum(v.numpy().nbytes for v in model.variables) / MIB
    if path:
        model = rewrite(model, Plan.from_json(path))
        compile_like_original(model)
    built = in_use()
    x, y = synthetic_xy(model, batch)
    with_batch = in_use()
    step = tf.function(step_function(model))
    before, peaks = [], []
    for _ in range(steps):
        before.append(in_use())
        tf.config.experimental.reset_memory_stats(device)
        tf.nest.map_structure(lambda t: t.numpy(), step(x, y))
        peaks.append(tf.config.experimental.get_memory_info(device)["peak"] / MIB)
    print(json.dumps({"variables_mib": variables_mib, "built_mib": built,
                      "with_batch_mib": with_batch, "before_mib": before,
                      "peaks_mib": peaks}))


def run_variant(name: str, variant: str, steps: int) -> dict[str, Any]:
    """Plans `variant` in one fresh process and measures it in another."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "plan.json")
        predicted = json_from_process([__file__, "--plan-worker", name, variant, path])
        measured = json_from_process([__file__, "--measure-worker", name,
                                      path if variant != "plain" else "", str(steps)])
    own = [peak - before for peak, before in zip(measured["peaks_mib"], measured["before_mib"])]
    return {"variant": variant, **predicted, **measured, "own_mib": own}


def markdown(data: dict[str, Any]) -> str:
    def numbers(values: list[float]) -> str:
        return ", ".join(f"{v:.1f}" for v in values)

    lines = ["# What the allocator holds before each step", "",
             f"Command: `{data['command']}`", "",
             f"Machine: {data['machine']}. " + " ".join(
                 __doc__.split("\n\n")[2].split()), ""]
    for model, rows in data["models"].items():
        lines += [f"## {model}", "",
                  "| variant | predicted peak (persistent) MiB | variables MiB | in use built, "
                  "with batch | in use before each step | each step's peak | step's own "
                  "bytes: median (predicted) |",
                  "|---|---|---:|---|---|---|---|"]
        for r in rows:
            updates = ", updates in the backward pass" if r["updates"] else ""
            plan = f" ({r['segments']} segments{updates})" if r["variant"] != "plain" else ""
            lines.append(
                f"| {r['variant']}{plan} | {r['predicted_mib']:.1f} ({r['persistent_mib']:.1f}) "
                f"| {r['variables_mib']:.1f} | {r['built_mib']:.1f}, {r['with_batch_mib']:.1f} "
                f"| {numbers(r['before_mib'])} | {numbers(r['peaks_mib'])} "
                f"| {statistics.median(r['own_mib']):.1f} "
                f"({r['predicted_mib'] - r['persistent_mib']:.1f}) |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ResNet152")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="Comma-separated: plain, or rows of planners.py, each "
                        f"maybe ending in {PINNED!r}.")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--output", default="step_drift",
                        help="Name of the result files under benchmarks/results/.")
    parser.add_argument("--plan-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--measure-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plan_worker:
        plan_worker(*args.plan_worker)
        return
    if args.measure_worker:
        name, path, steps = args.measure_worker
        measure_worker(name, path, int(steps))
        return
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v.removesuffix(PINNED) not in ("plain", *PLANNERS)]
    if unknown:
        parser.error(f"Unknown variant(s) {unknown}; choose plain or from {list(PLANNERS)}.")
    data = run_header(__file__, 1, args.steps)
    data["models"] = {}
    for name in model_names(parser, args.models, MODELS):
        data["models"][name] = []
        for variant in variants:
            print(f"{name}, {variant}:", flush=True)
            data["models"][name].append(run_variant(name, variant, args.steps))
    with open(os.path.join(RESULTS, f"{args.output}.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(data)
    with open(os.path.join(RESULTS, f"{args.output}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
