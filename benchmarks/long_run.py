"""A long training run under the Planner: does memory grow, does the budget hold?

Trains a small ResNet-style CNN (tfremat.demo.resnet_style, 48 px, batch 16,
SGD) for 2,000 steps (10 epochs of 200) with `tfremat.Planner` at 80% of the
predicted plain peak. At every epoch end it records the host memory of the
process (VmRSS from /proc/self/status), the device allocator's `current` bytes
and the Planner's measured peak of the epoch (`get_memory_info("CPU:0")`), and
writes benchmarks/results/long_run.md.

    python benchmarks/long_run.py                   # 10 epochs x 200 steps
    python benchmarks/long_run.py --epochs 2 --steps 20
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BATCH = 16


def rss_mib() -> float:
    """Resident host memory of this process, MiB (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("No VmRSS in /proc/self/status (not Linux?)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200, help="steps per epoch")
    parser.add_argument("--out", default=os.path.join(RESULTS, "long_run.md"))
    args = parser.parse_args(argv)

    import keras
    import tensorflow as tf

    import tfremat
    from tfremat.demo import resnet_style

    keras.utils.set_random_seed(0)
    model = resnet_style(image_size=48, width=16, blocks=(2, 2))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
    plain_mb = tfremat.simulate(tfremat.extract(model, batch_size=BATCH)).peak_mb
    budget_mb = round(0.8 * plain_mb, 1)

    def batch(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        # Made on the fly: a dataset holding every batch would sit in the
        # allocator whose peak is measured.
        seed = tf.stack([tf.constant(0, tf.int64), i])
        x = tf.random.stateless_normal((BATCH, 48, 48, 3), seed=seed)
        y = tf.random.stateless_uniform((BATCH,), seed=seed, maxval=10, dtype=tf.int32)
        return x, tf.one_hot(y, 10)

    data = tf.data.Dataset.range(args.steps).map(batch).repeat()
    rows: list[tuple[int, float, float, float, float]] = []

    class MemoryLog(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            current = tf.config.experimental.get_memory_info("CPU:0")["current"] / 2**20
            rows.append((epoch + 1, rss_mib(), current, logs["peak_memory_mb"],
                         time.perf_counter() - started))

    planner = tfremat.Planner(budget_mb, verbose=0)
    started = time.perf_counter()
    model.fit(data, steps_per_epoch=args.steps, epochs=args.epochs, verbose=0,
              callbacks=[planner, MemoryLog()])
    steps = args.epochs * args.steps
    peaks = [r[3] for r in rows]
    rss_growth = rows[-1][1] - rows[1][1] if len(rows) > 1 else 0.0
    current_growth = rows[-1][2] - rows[1][2] if len(rows) > 1 else 0.0
    lines = [
        "# Long run under the Planner",
        "",
        f"`python benchmarks/long_run.py --epochs {args.epochs} --steps {args.steps}`: "
        f"{steps} steps of `resnet_style(48 px, width 16, blocks (2, 2))`, batch {BATCH}, "
        f"SGD, on {tf.config.list_physical_devices()[0].device_type} "
        f"({os.cpu_count()} cores, TensorFlow {tf.__version__}, Keras {keras.__version__}).",
        f"Budget {budget_mb} MiB = 80% of the predicted plain peak {plain_mb:.1f} MiB; "
        f"plan by {planner.plan.planner}: {len(planner.plan.segments)} segments, predicted "
        f"{planner.predicted_peak_mb:.1f} MiB; re-plans: {planner.replans}.",
        "",
        "| epoch | steps | host RSS (MiB) | device current (MiB) | measured peak (MiB) "
        "| within budget | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for epoch, rss, current, peak, seconds in rows:
        lines.append(f"| {epoch} | {epoch * args.steps} | {rss:.1f} | {current:.2f} | "
                     f"{peak:.2f} | {'yes' if peak <= budget_mb else 'NO'} | {seconds:.0f} |")
    lines += [
        "",
        f"From the end of epoch 2 to the end of epoch {rows[-1][0]}: host RSS "
        f"{rss_growth:+.1f} MiB, device current {current_growth:+.2f} MiB. Measured peak "
        f"{min(peaks):.2f} .. {max(peaks):.2f} MiB against the budget of {budget_mb} MiB "
        f"({'within it in every epoch' if max(peaks) <= budget_mb else 'EXCEEDED'}).",
        "Epoch 1 includes tracing, planning and the first allocations, so growth is "
        "counted from epoch 2. A re-plan happens when a step's measured peak exceeds "
        "the budget; an epoch's peak counts its steps before and after it.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
