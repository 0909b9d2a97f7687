"""How a step's peak moves from one trace of it to the next, and what Grappler has to do with it.

The same training step, traced again with `tf.function` (same Python code, same
graph before optimisation), measures different peaks: each trace is optimised by
Grappler on its own. This script traces the demo's ResNet-style model (48 px,
width 16, batch 16, SGD), plain and with the plan of lowest predicted peak, several
times in one process and measures each trace's peak over a few steps; each
configuration (inter-op threads, Grappler's dependency optimizer on or off for the
step's calls) runs in a fresh process. Step time: the plan's fastest trace over the
plain step's fastest, in the same process.
Writes benchmarks/results/trace_order.md.

    python benchmarks/trace_order.py [--traces 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
CONFIGS = [(threads, deps) for threads in (1, 2) for deps in (True, False)]

WORKER = """
import json, sys, time
import tensorflow as tf
threads, deps, traces = int(sys.argv[1]), sys.argv[2] == "on", int(sys.argv[3])
tf.config.threading.set_inter_op_parallelism_threads(threads)
import tfremat
from tfremat.demo import resnet_style
from tfremat.memory import step_function, synthetic_batch
from tfremat.rewriter.install import PlanInstallation
import keras, contextlib

keras.utils.set_random_seed(3)
model = resnet_style(image_size=48, width=16, blocks=(2, 2))
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
graph = tfremat.extract(model, batch_size=16)
try:
    tfremat.plan(model, 1.0, graph=graph, update_in_backward=False)
except tfremat.BudgetError as e:
    lowest = e.min_budget_mb
plan = tfremat.plan(model, lowest, graph=graph, objective="memory", update_in_backward=False)
x_spec, y_spec = tf.TensorSpec((16, 48, 48, 3)), tf.TensorSpec((16, 10))
x, y = synthetic_batch(x_spec, 1), synthetic_batch(y_spec, 2)

def call(step):
    if not deps:  # the config is read when the call instantiates the function
        tf.config.optimizer.set_experimental_options({"dependency_optimization": False})
    try:
        step(x, y)
    finally:
        if not deps:
            tf.config.optimizer.set_experimental_options({"dependency_optimization": True})

rows = {}
for kind in ("plain", "plan"):
    patched = (PlanInstallation(model, plan)._patched_call() if kind == "plan"
               else contextlib.nullcontext())
    rows[kind] = []
    with patched:
        for _ in range(traces):
            step = tf.function(step_function(model))
            call(step)
            peaks, start = [], time.perf_counter()
            for _ in range(3):
                tf.config.experimental.reset_memory_stats("CPU:0")
                call(step)
                peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20)
            rows[kind].append({"peak_mib": max(peaks), "spread_mib": max(peaks) - min(peaks),
                               "seconds": (time.perf_counter() - start) / 3})
print(json.dumps({"rows": rows, "predicted_plain_mib": tfremat.simulate(graph).peak_mb,
                  "predicted_plan_mib": plan.peak_bytes / 2**20, "planner": plan.planner,
                  "segments": len(plan.segments)}))
"""


def run(threads: int, deps: bool, traces: int) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", WORKER, str(threads), "on" if deps else "off",
                          str(traces)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(results: dict, traces: int) -> str:
    lines = [
        "# One step, traced again: peaks per trace, with and without Grappler's dependency "
        "optimizer",
        "",
        f"`python benchmarks/trace_order.py --traces {traces}`: the demo's ResNet-style model "
        "(48 px, width 16, batch 16, SGD) on CPU (no oneDNN, BFC allocator), plain and with the "
        "plan of lowest predicted peak. Each row is one process; each trace is a new "
        "`tf.function` of the same step, measured over 3 steps after a warm-up (the "
        "peak of a trace moved by at most the spread shown). Time: the plan's fastest trace "
        "over the plain step's fastest, in the same process; plain step seconds are of "
        "different processes on a machine that may have been shared, compare them with care.",
        "",
        "| inter-op threads | dependency optimizer | plain: peak per trace (MiB) | "
        "plan: peak per trace (MiB) | predicted plain / plan (MiB) | plain step (s) | "
        "plan step / plain step |",
        "|---:|---|---|---|---|---:|---:|",
    ]
    for (threads, deps), r in results.items():
        plain = [t["peak_mib"] for t in r["rows"]["plain"]]
        plan = [t["peak_mib"] for t in r["rows"]["plan"]]
        plain_s = min(t["seconds"] for t in r["rows"]["plain"])
        plan_s = min(t["seconds"] for t in r["rows"]["plan"])
        lines.append(
            f"| {threads} | {'on (default)' if deps else 'off'} | "
            f"{', '.join(f'{p:.1f}' for p in plain)} | {', '.join(f'{p:.1f}' for p in plan)} | "
            f"{r['predicted_plain_mib']:.1f} / {r['predicted_plan_mib']:.1f} "
            f"({r['planner']}, {r['segments']} segments) | {plain_s:.3f} | {plan_s / plain_s:.2f}x |")
    spread = max(t["spread_mib"] for r in results.values() for k in ("plain", "plan")
                 for t in r["rows"][k])
    lines += ["", f"Largest spread of one trace over its 3 measured steps: {spread:.1f} MiB.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=6)
    args = parser.parse_args()
    results = {}
    for threads, deps in CONFIGS:
        results[(threads, deps)] = run(threads, deps, args.traces)
        print(f"threads {threads}, dependency optimizer {'on' if deps else 'off'}: done",
              flush=True)
    text = markdown(results, args.traces)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "trace_order.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
