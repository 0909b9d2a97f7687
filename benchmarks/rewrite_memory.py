"""Peak memory and step time of rewritten models vs the originals.

Segments: about sqrt(n) contiguous segments cut where a single tensor is live
(the test helper `tests/rewriter/rewrite_helpers.sqrt_segments`), applied with
`tfremat.rewriter.rewriting`. Peak: CPU allocator peak of one SGD training
step above the memory live before it. With XLA the peak changes from one
compilation of the same step to the next, so jit rows show the smallest peak
of `--compilations` compilations and, in brackets, the range. Step time:
median over steps run alternately (vanilla, rewritten, vanilla, ...) in one
process.

Usage:
    python benchmarks/rewrite_memory.py [--steps 10]

Prints a markdown table and writes it to benchmarks/results/rewrite_memory.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository: its tests' helpers

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.rewriter import rewrite_helpers as h  # noqa: E402
from tfremat.rewriter import rewrite_model  # noqa: E402

MODELS = {
    "ResNet50": keras.applications.ResNet50,
    "DenseNet121": keras.applications.DenseNet121,
}


def _mb(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.0f}" if round(low) == round(high) else f"{low:.0f} ({low:.0f}-{high:.0f})"


def step_seconds(steps: dict, x, y, repeats: int) -> dict:
    times: dict = {k: [] for k in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step(x, y).numpy()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--compilations", type=int, default=3)
    args = parser.parse_args()
    rows = ["| model | jit | segments | vanilla peak MB | rewritten peak MB | ratio "
            "| step-time ratio |", "|---|---|---|---|---|---|---|"]
    x = tf.random.normal((args.batch, args.size, args.size, 3))
    y = tf.random.normal((args.batch, 10))
    for name, build in MODELS.items():
        keras.utils.set_random_seed(0)
        model = build(weights=None, input_shape=(args.size, args.size, 3), classes=10)
        segments = h.sqrt_segments(model)
        rewritten = rewrite_model(model, h.plan_for(model, segments))
        for jit in (False, True):
            steps = {"vanilla": h.training_step(model, jit),
                     "rewritten": h.training_step(rewritten, jit)}
            peaks = {k: [h.step_peak_bytes(s, x, y) / 2**20] for k, s in steps.items()}
            for _ in range(args.compilations - 1 if jit else 0):
                for k, m in (("vanilla", model), ("rewritten", rewritten)):
                    peaks[k].append(h.step_peak_bytes(h.training_step(m, jit), x, y) / 2**20)
            seconds = step_seconds(steps, x, y, args.steps)
            rows.append(
                f"| {name} | {jit} | {len(segments)} | {_mb(peaks['vanilla'])} "
                f"| {_mb(peaks['rewritten'])} "
                f"| {min(peaks['rewritten']) / min(peaks['vanilla']):.2f}x "
                f"| {seconds['rewritten'] / seconds['vanilla']:.2f}x |")
            print(rows[-1], flush=True)
    table = "\n".join([
        f"Inputs {args.size}x{args.size}, batch {args.batch}, SGD, CPU, "
        f"{args.steps} interleaved steps; peak above the memory live before the step; "
        f"jit rows: smallest peak of {args.compilations} compilations (range).",
        "", *rows, ""])
    print(table)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "rewrite_memory.md"), "w") as f:
        f.write("# Rewrite: peak memory and step time\n\n"
                "Command: `python benchmarks/rewrite_memory.py`\n\n" + table)


if __name__ == "__main__":
    main()
