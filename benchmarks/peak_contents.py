"""What is live at the measured peak of a training step, from the profiler's memory events.

For each model of `planners.py` named (same sizes, SGD) and each variant, in a
fresh process: the plain step, the step with the optimizer's updates in the
backward pass (a plan without recomputation, `update_in_backward=True`), or a
row of `planners.PLANNERS` planned at its minimum budget (which also records
the simulator's predicted peak, where it is, and its largest buffers live
there, to set beside the measured ones): two
warm-up steps, then one step under TensorFlow's profiler with
`host_tracer_level=3`, which records every allocation and deallocation of the
allocator with its op, region type and shape and the bytes in use after it.
Replaying them up to the largest bytes in use gives the buffers live at the
step's peak (the bytes each holds, its allocator chunk, and the bytes it
asked for), grouped as forward outputs, weight gradients (`BackpropFilter`,
`BiasAddGrad`, a `MatMul`'s second gradient), other gradients, and variable
assignments (the optimizer's ops, BatchNorm's statistics); the buffers
allocated before the step (weights, batch) are only known as a total. Also:
the assignments' allocations kept after the step (the variables an
assignment copied because their old value was still read),
the largest buffers live at the peak, and when the variable updates start
relative to the weight-gradient ops (the profiler's op events of the same step).

Usage:
    python benchmarks/peak_contents.py [--models ResNet50,VGG19]
        [--variants plain,updates] [--output peak_contents]

Writes benchmarks/results/<output>.md.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import statistics
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planners import MODELS, PLANNERS, RESULTS, model_names, run_header  # noqa: E402

MIB = 2**20
WEIGHT_GRADIENT_OPS = ("BackpropFilter", "BiasAddGrad", "MatMul_1")
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")


def memory_events(name: str, variant: str
                  ) -> tuple[list[tuple[int, str, dict]], float, list[tuple[int, int, str]],
                             dict[str, Any]]:
    """The allocator's events during one step of `name`, in time order; the
    peak `get_memory_info` reports for that step; its ops' (start, end,
    name), in picoseconds; and, for a planned variant, the simulator's
    prediction (`predicted`). `variant`: "plain", "updates" (the optimizer's
    updates in the backward pass, without recomputation) or a row of
    `PLANNERS` planned at its minimum budget."""
    import tensorflow as tf
    from planners import build_model, compile_like_original, plan_at_minimum, synthetic_xy

    from tfremat.api import rewrite
    from tfremat.core import Plan
    from tfremat.graph import extract, profiler, step_function

    model, batch = build_model(name)
    prediction: dict[str, Any] = {}
    if variant != "plain":
        graph = extract(model, batch_size=batch)
        if variant == "updates":
            plan = Plan.from_segments(graph, [], planner="none", update_in_backward=True)
        else:
            plan = plan_at_minimum(graph, variant)
            prediction = predicted(graph, plan)
        model = rewrite(model, plan)
        compile_like_original(model)
    x, y = synthetic_xy(model, batch)
    step = tf.function(step_function(model))
    step(x, y)
    step(x, y)
    tf.config.experimental.reset_memory_stats("CPU:0")
    with profiler.profiled(host_tracer_level=3) as session:
        step(x, y)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / MIB
    if session is None or session.space is None:
        raise SystemExit("the profiler could not record the step")
    events, ops = [], []
    for event in profiler.events(session.space):
        if ":" in event.name and "/" in event.name:  # "scope/op_name:OpType"
            ops.append((event.start_ps, event.end_ps, event.name.split(":")[0]))
        elif event.name in ("MemoryAllocation", "MemoryDeallocation"):
            events.append((event.start_ps, event.name, event.stats))
    events.sort(key=lambda e: e[0])
    return events, peak, sorted(ops), prediction


def predicted(graph: Any, plan: Any) -> dict[str, Any]:
    """The simulator's peak for `plan`, the step of the schedule it is at, its
    persistent bytes, and the largest buffers live there."""
    from tfremat.simulation import build_schedule, simulate

    estimate = simulate(graph, plan)
    schedule = build_schedule(graph, plan)
    at = max(range(len(estimate.timeline)), key=lambda k: estimate.timeline[k][1])
    live = sorted(((schedule.size[key], key) for key, made in schedule.alloc_step.items()
                   if made <= at <= schedule.last_use[key] and schedule.size[key]),
                  key=lambda item: -item[0])
    return {"peak_mib": estimate.peak_bytes / MIB, "at": estimate.timeline[at][0],
            "persistent_mib": estimate.persistent_bytes / MIB,
            "segments": len(plan.segments), "pinned": bool(plan.pin_order),
            "step_buffers_mib": sum(size for size, _ in live) / MIB,
            "transient_mib": schedule.transient[at] / MIB,
            "largest": [{"mib": size / MIB, "buffer": str(key)} for size, key in live[:8]]}


def update_delays(ops: list[tuple[int, int, str]]) -> dict[str, Any]:
    """When the variable assignments of the backward pass (the optimizer's
    updates) start: after the latest weight-gradient op to end before each, in
    ms (median, largest), and how many start once the last gradient op has
    ended."""
    ends = sorted(end for _, end, op in ops if kind_of(op) == "weight gradients")
    first = min(start for start, _, op in ops if kind_of(op) == "weight gradients")
    last = max(end for _, end, op in ops if op.startswith("gradient_tape/"))
    # Assignments from the first weight gradient on (BatchNorm's statistics are
    # assigned in the forward pass).
    starts: dict[str, int] = {}  # an op can show on more than one line of the trace
    for start, _, op in ops:
        if is_assignment(op) and start >= first:
            starts[op] = min(start, starts.get(op, start))
    updates = list(starts.values())
    delays = [(start - ends[i - 1]) / 1e9 for start in updates
              if (i := bisect.bisect_right(ends, start)) > 0]
    return {"updates": len(updates),
            "median_ms": statistics.median(delays) if delays else None,
            "max_ms": max(delays) if delays else None,
            "after_backward": sum(start >= last for start in updates)}


def is_assignment(op: str) -> bool:
    """Whether the op (by its name) writes a variable."""
    return op.rsplit("/", 1)[-1].startswith(("Assign", "ResourceApply"))


def kind_of(op: str) -> str:
    """The group of an op's buffers, by the op's name."""
    if op.split("/")[0].lower() in OPTIMIZERS or is_assignment(op):
        return "variable assignments"
    if op.startswith("gradient_tape/"):
        if any(k in op for k in WEIGHT_GRADIENT_OPS):
            return "weight gradients"
        return "other gradients"
    return "forward outputs" if "/" in op else "other"


def analyse(events: list[tuple[int, str, dict]], measured_peak: float) -> dict[str, Any]:
    """The buffers live at the largest bytes in use, and the variable
    assignments' kept ones."""
    first = events[0][2]
    size = first.get("allocation_bytes") or 0
    before = (first["bytes_allocated"] - size if events[0][1] == "MemoryAllocation"
              else first["bytes_allocated"] + size)
    live: dict[int, dict] = {}
    peak, snapshot = 0, {}
    for _, kind, stats in events:
        if kind == "MemoryAllocation":
            live[stats["addr"]] = stats
        else:
            live.pop(stats["addr"], None)
        if stats["bytes_allocated"] > peak:
            peak, snapshot = stats["bytes_allocated"], dict(live)
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for stats in snapshot.values():
        group = groups[kind_of(stats.get("tf_op") or "")]
        group[0] += stats["allocation_bytes"] / MIB
        group[1] += (stats.get("requested_bytes") or 0) / MIB
    kept = [s for s in live.values()
            if kind_of(s.get("tf_op") or "") == "variable assignments"]
    largest = sorted(snapshot.values(), key=lambda s: -s["allocation_bytes"])[:8]
    return {"measured_peak_mib": measured_peak, "events_peak_mib": peak / MIB,
            "before_step_mib": before / MIB, "groups_mib": dict(groups),
            "assignments_kept": {"count": len(kept),
                                 "mib": sum(s["allocation_bytes"] for s in kept) / MIB},
            "largest": [{"mib": s["allocation_bytes"] / MIB,
                         "requested_mib": (s.get("requested_bytes") or 0) / MIB,
                         "region": s.get("region_type"),
                         "shape": s.get("shape"), "op": s.get("tf_op")} for s in largest]}


def markdown(data: dict[str, Any]) -> str:
    lines = ["# What is live at the measured peak of a training step", "",
             f"Command: `{data['command']}`", "",
             f"Machine: {data['machine']}. " + __doc__.split("\n\n")[1].replace("\n", " "),
             ""]
    for rec in data["records"]:
        lines += [f"## {rec['model']}", "",
                  f"Peak: {rec['measured_peak_mib']:.1f} MiB (`get_memory_info`), "
                  f"{rec['events_peak_mib']:.1f} MiB from the events; in use before the "
                  f"step (weights, batch): {rec['before_step_mib']:.1f} MiB. Allocations of "
                  f"variable assignments kept after the step (copied variables): "
                  f"{rec['assignments_kept']['count']}, {rec['assignments_kept']['mib']:.1f} MiB. "
                  f"The {rec['updates']['updates']} variable updates started a median "
                  f"{rec['updates']['median_ms']:.2f} ms (at most "
                  f"{rec['updates']['max_ms']:.2f} ms) after the latest weight-gradient op "
                  f"to end before them; {rec['updates']['after_backward']} after the "
                  "backward pass's last gradient op.",
                  "", "| live at the peak | MiB held (allocator chunks) | MiB requested |",
                  "|---|---:|---:|"]
        lines += [f"| {k} | {held:.1f} | {asked:.1f} |" for k, (held, asked) in
                  sorted(rec["groups_mib"].items(), key=lambda kv: -kv[1][0])]
        lines += ["", "| largest buffers at the peak | MiB held | MiB requested | region "
                  "| shape |", "|---|---:|---:|---|---|"]
        lines += [f"| `{b['op']}` | {b['mib']:.2f} | {b['requested_mib']:.2f} | "
                  f"{b['region']} | {b['shape']} |" for b in rec["largest"]]
        lines.append("")
        pred = rec.get("predicted")
        if pred:
            lines += [f"Predicted ({pred['segments']} segments, "
                      f"{'pinned' if pred['pinned'] else 'free'}): {pred['peak_mib']:.1f} MiB "
                      f"at `{pred['at']}`, {pred['persistent_mib']:.1f} of them persistent; "
                      f"the buffers the step made live there: {pred['step_buffers_mib']:.1f} MiB, "
                      f"and {pred['transient_mib']:.1f} MiB of workspace.", "",
                      "| largest buffers at the predicted peak | MiB |", "|---|---:|"]
            lines += [f"| `{b['buffer']}` | {b['mib']:.2f} |" for b in pred["largest"]]
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ResNet50,VGG19")
    parser.add_argument("--variants", default="plain,updates",
                        help="plain, updates, or rows of planners.PLANNERS, comma-separated")
    parser.add_argument("--output", default="peak_contents")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, variant = args.worker
        events, peak, ops, prediction = memory_events(name, variant)
        label = {"plain": "", "updates": " with updates in the backward pass"}.get(
            variant, f", {variant} at its minimum")
        print(json.dumps({"model": name + label, **analyse(events, peak),
                          "updates": update_delays(ops), "predicted": prediction}))
        return
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in ("plain", "updates") and v not in PLANNERS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose plain, updates or {list(PLANNERS)}")
    data = run_header(__file__, 1, 1)
    for name in model_names(parser, args.models, MODELS):
        for variant in variants:
            out = subprocess.run([sys.executable, __file__, "--worker", name, variant],
                                 check=True, capture_output=True, text=True).stdout
            data["records"].append(json.loads(out.strip().splitlines()[-1]))
    text = markdown(data)
    with open(os.path.join(RESULTS, f"{args.output}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
