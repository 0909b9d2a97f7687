"""Peak memory and step time of rewritten models vs the originals, with and without XLA.

Segments: about sqrt(n) contiguous segments cut where a single tensor is live
(the test helper `tests/rewriter/rewrite_helpers.sqrt_segments`), applied with
`tfremat.rewriter.rewrite_model`. Three ways to run the SGD step:

- `executor`: `jit_compile=False`, TensorFlow's executor;
- `xla`: `jit_compile=True`, XLA's CPU compiler as it comes, whose scheduler
  orders the program for concurrency;
- `xla-memory`: `jit_compile=True` with
  `XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false`, XLA's
  scheduler that orders for memory;
- `xla-units`: what tfremat runs for a model compiled with `jit_compile=True`:
  the plain step compiled whole by XLA, the rewritten one with each segment
  compiled by XLA on its own (its forward pass, and its recompute with its
  gradients) and the step between them run by the executor
  (`tfremat.rewriter.compilers.units_compiled`).

Each way runs without and with the optimizer's updates inside the backward pass
(`Plan.update_in_backward`, on the plain model and on the segments alike).

Every peak is measured in a fresh process (a process that ran other steps
measures higher): the allocator's peak of one step above the memory live
before it, the smallest of `--repeats` steps. Under XLA the step's temporaries
are one allocation, which the allocator hands out in a chunk that may be much
larger, so the table also gives XLA's own size for it (its buffer assignment,
read from `--xla_dump_to`'s memory-usage report). "Kept": the saving
(plain - rewritten) as a share of the executor's. Step time: the rewritten
step over the plain one, steps run alternately in one process per way.

Usage:
    python benchmarks/rewrite_memory.py [--models ResNet50,DenseNet121] [--steps 10]

Prints a markdown table and writes it to benchmarks/results/rewrite_memory.md.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")  # the repository: its tests' helpers
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from planners import json_from_process, machine, step_seconds  # noqa: E402

MODELS = ("ResNet50", "DenseNet121")
WAYS = {"executor": (False, ""),
        "xla": (True, ""),
        "xla-memory": (True, "--xla_cpu_enable_concurrency_optimized_scheduler=false"),
        "xla-units": (True, "")}
MIB = 2**20


def build(name: str, size: int, variant: str, updates: bool) -> tuple[Any, int]:
    """The keras.applications model `name`, rewritten with sqrt(n) segments
    when `variant` is `"rewritten"`, and for updates in the backward pass with
    `updates` (then compiled with SGD, which the rewrite updates through); and
    the number of segments."""
    import keras

    from tests.rewriter import rewrite_helpers as h
    from tfremat.rewriter import rewrite_model

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3),
                                              classes=10)
    segments = h.sqrt_segments(model)
    plan = h.plan_for(model, segments if variant == "rewritten" else [])
    if updates:
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        model.optimizer.build(model.trainable_variables)
        plan.update_in_backward = True
    if plan.segments or updates:
        rewritten = rewrite_model(model, plan)
        if updates:
            rewritten.compile(optimizer=model.optimizer, loss="mse")
        model = rewritten
    return model, len(segments)


def batch(size: int, batch_size: int) -> tuple[Any, Any]:
    import tensorflow as tf

    return (tf.random.normal((batch_size, size, size, 3)),
            tf.random.normal((batch_size, 10)))


def xla_temp_bytes(dump: str) -> int | None:
    """The step's temporary allocation as XLA's buffer assignment sized it."""
    reports = glob.glob(os.path.join(dump, "*inference_step*memory-usage-report.txt"))
    sizes = [int(float(m.group(1)) * MIB) for path in reports
             for m in [re.search(r"size ([\d.]+)MiB, preallocated-temp", open(path).read())]
             if m]
    return max(sizes) if sizes else None


def traced_as(way: str) -> Any:
    """Where the steps of `way` are traced: within `units_compiled()` for
    `xla-units` (a segment traced there compiles itself with XLA)."""
    from tfremat.rewriter.compilers import units_compiled

    return units_compiled() if way == "xla-units" else contextlib.nullcontext()


def jit_compile(way: str, variant: str) -> bool:
    """Whether the step of `variant` run `way` is compiled whole by XLA."""
    return WAYS[way][0] and not (way == "xla-units" and variant == "rewritten")


def peak_worker(name: str, way: str, variant: str, updates: bool,
                args: argparse.Namespace) -> None:
    """One variant's step in this (fresh) process: prints its peak and the
    number of segments as JSON."""
    from tests.rewriter import rewrite_helpers as h

    x, y = batch(args.size, args.batch)
    model, segments = build(name, args.size, variant, updates)
    step = h.training_step(model, jit_compile(way, variant))
    with traced_as(way):
        peak = h.step_peak_bytes(step, x, y, repeats=args.repeats)
    print(json.dumps({"peak": peak, "segments": segments}))


def time_worker(name: str, way: str, updates: bool, args: argparse.Namespace) -> None:
    """The rewritten step's time over the plain one's, run alternately: JSON."""
    from tests.rewriter import rewrite_helpers as h

    x, y = batch(args.size, args.batch)
    runs = {}
    for v in ("plain", "rewritten"):
        step = h.training_step(build(name, args.size, v, updates)[0], jit_compile(way, v))
        with traced_as(way):
            step(x, y).numpy()  # trace and compile
        runs[v] = lambda step=step: step(x, y).numpy()
    seconds = step_seconds(runs, args.steps)
    print(json.dumps({"ratio": seconds["rewritten"] / seconds["plain"]}))


def in_fresh_process(flags: list[str], way: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs this script with `flags` in a process of its own, XLA's flags set
    for `way`; the JSON it prints last, with `"xla_temp"` (under XLA, read from
    the program it dumped; else None)."""
    with tempfile.TemporaryDirectory() as dump:
        xla_flags = " ".join(f for f in (WAYS[way][1], f"--xla_dump_to={dump}"
                                         if WAYS[way][0] else "") if f)
        env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3",
               "XLA_FLAGS": xla_flags}
        result = json_from_process(
            [__file__, *flags, "--size", str(args.size), "--batch", str(args.batch),
             "--repeats", str(args.repeats), "--steps", str(args.steps)], env=env)
        return {**result, "xla_temp": xla_temp_bytes(dump) if WAYS[way][0] else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--time", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        *where, updates = args.peak
        return peak_worker(*where, updates == "yes", args)
    if args.time:
        *where, updates = args.time
        return time_worker(*where, updates == "yes", args)
    rows = ["| model | way | updates in backward | segments | plain peak MiB (XLA's temp) "
            "| rewritten peak MiB (XLA's temp) | ratio | saving kept | step-time ratio |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        for updates in (False, True):
            executor_saving = None
            for way in WAYS:
                text, saving = row(name, way, updates, args, executor_saving)
                executor_saving = executor_saving or saving
                rows.append(text)
                print(text, flush=True)
    table = "\n".join([
        f"Machine: {machine()}.", "",
        f"Inputs {args.size}x{args.size}, batch {args.batch}, SGD, CPU. Peaks: "
        f"allocator peak above the memory live before the step, smallest of "
        f"{args.repeats} steps, each variant in a fresh process; in brackets, under "
        "XLA, the step's temporary allocation as XLA's buffer assignment sized it, "
        "which the ratio and the saving use. Saving kept: (plain - rewritten) over "
        "the executor's with the same updates setting; `xla-units` compares the "
        "rewritten step, its segments compiled by XLA on their own, with the plain "
        "step compiled whole. Step time: median of "
        f"{args.steps} steps run alternately.", "", *rows, ""])
    print(table)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "rewrite_memory.md"), "w") as f:
        f.write("# Rewrite: peak memory and step time, with and without XLA\n\n"
                f"Command: `python benchmarks/rewrite_memory.py`\n\n{table}")


def row(name: str, way: str, updates: bool, args: argparse.Namespace,
        executor_saving: int | None) -> tuple[str, int]:
    """Measures the plain and rewritten step of one way: the table row, and the
    saving in bytes (the executor's is the first, `executor_saving` None)."""

    def mib(value: int | None) -> str:
        return "" if value is None else f"{value / MIB:.1f}"

    switch = "yes" if updates else "no"  # the workers' command line
    peaks = {v: in_fresh_process(["--peak", name, way, v, switch], way, args)
             for v in ("plain", "rewritten")}
    ratio = in_fresh_process(["--time", name, way, switch], way, args)["ratio"]
    # XLA's own size where it has one: the allocator's chunk hides the saving.
    sizes = {v: p["xla_temp"] or p["peak"] for v, p in peaks.items()}
    saving = sizes["plain"] - sizes["rewritten"]
    text = (f"| {name} | {way} | {switch} "
            f"| {peaks['rewritten']['segments']} "
            f"| {mib(peaks['plain']['peak'])} ({mib(peaks['plain']['xla_temp'])}) "
            f"| {mib(peaks['rewritten']['peak'])} ({mib(peaks['rewritten']['xla_temp'])}) "
            f"| {sizes['rewritten'] / sizes['plain']:.2f}x "
            f"| {saving / (executor_saving or saving):.0%} | {ratio:.2f}x |"
            .replace(" ()", ""))
    return text, saving


if __name__ == "__main__":
    main()
