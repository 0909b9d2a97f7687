"""Predicted vs measured peak memory of one training step, per model.

Each model runs in a fresh subprocess so that nothing else sits in the
allocator. Prints a markdown table and writes benchmarks/results/simulator_fidelity.md.

    python benchmarks/simulator_fidelity.py            # the default set, a model per family
    python benchmarks/simulator_fidelity.py ResNet50:96:16
"""

from __future__ import annotations

import json
import os
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


def measure_one(case: str) -> dict:
    import keras

    import tfremat

    name, px, batch = case.split(":")
    model = getattr(keras.applications, name)(
        weights=None, input_shape=(int(px), int(px), 3), classes=10)
    model.compile(optimizer="sgd", loss="categorical_crossentropy")
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


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--one":
        print(json.dumps(measure_one(argv[1])))
        return
    cases = argv or CASES
    rows = []
    for case in dict.fromkeys(cases + FAMILIES + TIMING_MODELS if not argv else cases):
        out = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True,
                             text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            raise SystemExit(f"{case} failed")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"done {case}", file=sys.stderr)
    lines = [
        "# Simulator fidelity: predicted vs measured peak of one training step",
        "",
        f"`python benchmarks/simulator_fidelity.py` on {machine()}, "
        f"device {rows[0]['device']}; SGD, categorical "
        "cross-entropy, keras.applications with weights=None and 10 classes. Measured: "
        "`get_memory_info(device)['peak']` after `reset_memory_stats`, each model alone "
        "in a fresh process. Peaks include weights, optimizer state and the batch.",
        "",
        "| model:px:batch | nodes | predicted MiB | measured MiB | error | persistent MiB "
        "| extract s | simulate ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        err = r["predicted_mb"] / r["measured_mb"] - 1
        lines.append(
            f"| {r['case']} | {r['nodes']} | {r['predicted_mb']:.1f} | {r['measured_mb']:.1f} "
            f"| {err:+.1%} | {r['persistent_mb']:.1f} | {r['extract_s']:.2f} "
            f"| {r['simulate_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    path = os.path.join(os.path.dirname(__file__), "results", "simulator_fidelity.md")
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
