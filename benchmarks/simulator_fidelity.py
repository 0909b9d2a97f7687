"""Predicted vs measured peak memory of one training step, per model.

Each model runs in fresh subprocesses (`--runs`, 3 by default) so that
nothing else sits in the allocator; a plain step's peak moves between processes
with the order two inter-op threads run ready kernels (VGG19 at batch 8 measured
517.5, 560.6 and 604.8 MiB in three), so the table gives the median and range.
Prints a markdown table and writes benchmarks/results/simulator_fidelity.md.

    python benchmarks/simulator_fidelity.py            # the default set, a model per family
    python benchmarks/simulator_fidelity.py --runs 5 ResNet50:96:16
    python benchmarks/simulator_fidelity.py --optimizers  # OPTIMIZERS on OPTIMIZER_CASES

A case may name its optimizer as a fourth field (`VGG19:96:16:momentum`, a key of
`OPTIMIZERS`; SGD otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planners import machine  # noqa: E402

CASES = ["ResNet50:96:16", "ResNet50:128:16", "DenseNet121:96:16", "MobileNetV2:128:16",
         "VGG19:96:8", "InceptionV3:139:8", "EfficientNetB0:96:16"]
#: One model of each other keras.applications family (issue #12: validate on
#: every family, not only the benchmarks').
FAMILIES = ["ConvNeXtTiny:96:16", "EfficientNetV2B0:96:16", "InceptionResNetV2:96:16",
            "MobileNet:96:16", "MobileNetV3Small:96:16", "NASNetMobile:96:16",
            "ResNet50V2:96:16", "Xception:96:16"]
TIMING_MODELS = ["ResNet50:96:16", "ResNet152:96:16"]
#: Optimizers a case may name: a `keras.optimizers` class and its arguments.
OPTIMIZERS = {"sgd": ("SGD", {"learning_rate": 0.01}),
              "momentum": ("SGD", {"learning_rate": 0.01, "momentum": 0.9}),
              "adam": ("Adam", {}), "rmsprop": ("RMSprop", {})}
#: The models `--optimizers` runs with each of `OPTIMIZERS`: `planners.py`'s sizes.
OPTIMIZER_CASES = ["ResNet50:96:16", "VGG19:96:16", "MobileNetV2:96:16", "DenseNet121:96:16"]


def measure_one(case: str) -> dict:
    import keras

    import tfremat

    name, px, batch, *named = case.split(":")
    model = getattr(keras.applications, name)(
        weights=None, input_shape=(int(px), int(px), 3), classes=10)
    kind, kwargs = OPTIMIZERS[named[0] if named else "sgd"]
    optimizer = getattr(keras.optimizers, kind)(**kwargs)
    model.compile(optimizer=optimizer, loss="categorical_crossentropy")
    started = time.perf_counter()
    graph = tfremat.extract(model, batch_size=int(batch))
    extract_s = time.perf_counter() - started
    est = tfremat.simulate(graph)
    started = time.perf_counter()
    for _ in range(20):
        tfremat.simulate(graph)
    simulate_ms = (time.perf_counter() - started) / 20 * 1000
    measured = tfremat.measure_peak(model, batch_size=int(batch), return_details=True)
    return {
        "case": case, "nodes": len(graph), "extract_s": extract_s, "simulate_ms": simulate_ms,
        "predicted_mb": est.peak_mb, "measured_mb": measured.peak_mb,
        "persistent_mb": graph.total_persistent_bytes / 2**20,
        "device": measured.device,
    }


def run_one(case: str) -> dict:
    """`measure_one(case)` in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True,
                         text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if out.returncode:
        print(out.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"{case} failed")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--one":
        print(json.dumps(measure_one(argv[1])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="model:px:batch (default: a model per family)")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per model")
    parser.add_argument("--optimizers", action="store_true",
                        help="each of OPTIMIZERS on OPTIMIZER_CASES (written to "
                             "simulator_fidelity_optimizers.md)")
    args = parser.parse_args(argv)
    if args.optimizers:
        cases = [f"{c}:{o}" for c in args.cases or OPTIMIZER_CASES for o in OPTIMIZERS]
    else:
        cases = args.cases or list(dict.fromkeys(CASES + FAMILIES + TIMING_MODELS))
    runs: dict[str, list[dict]] = {case: [] for case in cases}
    # Round-robin: a slow drift of the machine spreads over every model alike.
    for i in range(args.runs):
        for case in cases:
            runs[case].append(run_one(case))
            print(f"done {case} ({i + 1}/{args.runs})", file=sys.stderr)
    lines = [
        "# Simulator fidelity: predicted vs measured peak of one training step",
        "",
        f"`python benchmarks/simulator_fidelity.py{' --optimizers' if args.optimizers else ''}`"
        f" on {machine()}, device {runs[cases[0]][0]['device']}; "
        f"{'the optimizer named last' if args.optimizers else 'SGD'} (`OPTIMIZERS`), categorical "
        "cross-entropy, keras.applications with weights=None and 10 classes. Measured: "
        "`get_memory_info(device)['peak']` after `reset_memory_stats`, the larger of two "
        f"steps after a warm-up, each model alone in a fresh process, {args.runs} "
        "processes per model (median and range). Predicted: the simulator's peak, which "
        "includes the convolutions' scratch measured in that process (the median). "
        "Error: predicted against the median measured. Peaks include weights, optimizer "
        "state and the batch.",
        "",
        f"| model:px:batch{':optimizer' if args.optimizers else ''} | nodes | predicted MiB | measured MiB, median | range "
        "| error | persistent MiB | extract s | simulate ms |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    errors = []
    inside = 0
    for case in cases:
        rs = runs[case]
        measured = [r["measured_mb"] for r in rs]
        predicted = statistics.median(r["predicted_mb"] for r in rs)
        err = predicted / statistics.median(measured) - 1
        errors.append(abs(err))
        inside += min(measured) <= predicted <= max(measured)
        r = rs[0]
        lines.append(
            f"| {case} | {r['nodes']} | {predicted:.1f} | {statistics.median(measured):.1f} "
            f"| {min(measured):.1f}-{max(measured):.1f} | {err:+.1%} "
            f"| {r['persistent_mb']:.1f} "
            f"| {statistics.median(x['extract_s'] for x in rs):.2f} "
            f"| {statistics.median(x['simulate_ms'] for x in rs):.1f} |")
    lines += [
        "",
        f"{sum(e <= 0.05 for e in errors)} of {len(cases)} predicted within 5% of the "
        f"median measured, {sum(e <= 0.10 for e in errors)} within 10%; median error "
        f"{statistics.median(errors):.1%}, worst {max(errors):.1%}; {inside} of "
        f"{len(cases)} predictions inside their measured range.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    path = os.path.join(os.path.dirname(__file__), "results", "simulator_fidelity"
                        + ("_optimizers" if args.optimizers else "") + ".md")
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
