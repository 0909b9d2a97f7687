"""What pinning the backward order (`Plan.pin_order`) does to peaks, their spread and step time.

TensorFlow's executor runs ready kernels side by side on its inter-op threads, and
which one a thread picks is a race: a weight gradient's kernel (on CPU a 3x3
`Conv2DBackpropFilter` holds about three times its input in scratch) may still run
while the next layer's backward starts, so the same step peaks in two modes. A
pinned order hands each unit's input gradients on only once its weight gradients
exist. On one inter-op thread the executor's order is no race, but unpinned it
can keep what recomputation freed. This script trains the demo's ResNet-style
model (width 16, batch 16, SGD) plain and with the plan of lowest predicted peak,
each without and with the pinned order, on two inter-op threads and on one, each
in fresh processes, and measures every step's peak (statistics reset before each
step). With `--load`, each variant runs again beside two processes that keep both
cores busy with matrix products. Time: the variant's median step over the plain
(unpinned, no plan) step's median, timed first in the same process; and the
variant's median step in milliseconds.
Writes benchmarks/results/pin_order.md.

    python benchmarks/pin_order.py [--steps 30] [--runs 2] [--load]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
IMAGE_SIZES = (48, 64)
VARIANTS = [(plan, pin) for plan in ("plain", "lowest") for pin in (False, True)]
THREADS = (2, 1)  # inter-op threads

WORKER = """
import json, statistics, sys, time
import keras, numpy as np, tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(int(sys.argv[5]))
import tfremat
from tfremat.demo import resnet_style
from tfremat.rewriter import PlanInstallation

size, kind, pin, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "pin", int(sys.argv[4])
keras.utils.set_random_seed(3)
model = resnet_style(image_size=size, width=16, blocks=(2, 2))
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
rng = np.random.default_rng(0)
x = rng.standard_normal((16 * (steps + 1), size, size, 3)).astype("float32")
y = keras.utils.to_categorical(rng.integers(0, 10, 16 * (steps + 1)), 10)
graph = tfremat.extract(model, batch_size=16)
segments = []
if kind == "lowest":
    try:
        tfremat.plan(model, 1.0, graph=graph, update_in_backward=False)
    except tfremat.BudgetError as e:
        segments = tfremat.plan(model, e.min_budget_mb, graph=graph, objective="memory",
                                update_in_backward=False).segments
plan = tfremat.Plan.from_segments(graph, segments, pin_order=pin)
peaks, seconds = [], []

class Steps(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        tf.config.experimental.reset_memory_stats("CPU:0")
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        seconds.append(time.perf_counter() - self.start)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20)

def fit():
    peaks.clear(); seconds.clear()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[Steps()])
    return peaks[1:], statistics.median(seconds[1:])

_, plain_seconds = fit()
with PlanInstallation(model, plan):
    variant_peaks, variant_seconds = fit()
print(json.dumps({"peaks": variant_peaks, "time_ratio": variant_seconds / plain_seconds,
                  "step_ms": 1000 * variant_seconds,
                  "predicted": tfremat.simulate(graph, plan).peak_mb,
                  "segments": len(segments), "data_mib": (x.nbytes + y.nbytes) / 2**20}))
"""

#: Keeps a core busy with matrix products until killed (the `--load` rows).
BUSY = """
import tensorflow as tf
a = tf.random.normal((600, 600))
while True:
    a = tf.tanh(a @ a)
"""


def run(size: int, kind: str, pin: bool, steps: int, threads: int, load: bool) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    busy = [subprocess.Popen([sys.executable, "-c", BUSY], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(2 if load else 0)]
    try:
        out = subprocess.run([sys.executable, "-c", WORKER, str(size), kind,
                              "pin" if pin else "free", str(steps), str(threads)],
                             env=env, capture_output=True, text=True, check=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(results: dict, steps: int, runs: int, load: bool) -> str:
    lines = [
        "# Pinning the backward order: per-step peaks and step time",
        "",
        f"`python benchmarks/pin_order.py --steps {steps} --runs {runs}"
        f"{' --load' if load else ''}`: the demo's "
        "ResNet-style model (width 16, blocks (2, 2), batch 16, SGD) on CPU (2 cores, two "
        "inter-op threads or one, no oneDNN, BFC allocator); 'load': beside two processes "
        "keeping both cores busy with matrix products. Each run is a fresh process: "
        f"{steps} steps after a warm-up, the allocator's statistics reset before each step. "
        "Peaks: min / median / max over the steps of each run. Time: the median step over "
        "the median plain step (no plan, unpinned) timed first in the same process. The "
        "measured peaks include the training arrays, which Keras's `fit` holds as tensors "
        "for the whole epoch and the prediction does not count (column 'data').",
        "",
        "| px | threads | load | plan | order | predicted (MiB) | data (MiB) | "
        "per-step peaks by run (MiB) | max / median | step time vs plain | step (ms) |",
        "|---:|---:|---|---|---|---:|---:|---|---:|---|---|",
    ]
    for (size, threads, busy, kind, pin), rs in results.items():
        peaks = "; ".join(f"{min(r['peaks']):.1f} / {statistics.median(r['peaks']):.1f} / "
                          f"{max(r['peaks']):.1f}" for r in rs)
        worst = max(max(r["peaks"]) / statistics.median(r["peaks"]) for r in rs)
        plan = "lowest" + f" ({rs[0]['segments']} segments)" if kind == "lowest" else "none"
        lines.append(
            f"| {size} | {threads} | {'yes' if busy else 'no'} | {plan} | "
            f"{'pinned' if pin else 'free'} | {rs[0]['predicted']:.1f} | "
            f"{rs[0]['data_mib']:.1f} | {peaks} | {worst:.2f} | "
            f"{', '.join(format(r['time_ratio'], '.2f') + 'x' for r in rs)} | "
            f"{', '.join(format(r['step_ms'], '.0f') for r in rs)} |")
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--load", action="store_true",
                        help="run each variant also beside two busy processes")
    args = parser.parse_args()
    results = {}
    for size in IMAGE_SIZES:
        for threads in THREADS:
            for busy in (False, True) if args.load else (False,):
                for kind, pin in VARIANTS:
                    results[(size, threads, busy, kind, pin)] = [
                        run(size, kind, pin, args.steps, threads, busy)
                        for _ in range(args.runs)]
                    print(f"{size} px, {threads} thread(s), load {busy}, {kind}, "
                          f"{'pinned' if pin else 'free'}: done", flush=True)
    text = markdown(results, args.steps, args.runs, args.load)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "pin_order.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
