"""Host offload: keep some activations in host memory between forward and backward.

An offloaded activation is copied to the host after the layer making it and
copied back, ahead of its use, during the backward pass. Nothing is recomputed,
so where the copies hide behind compute it costs no time; the step must run
outside XLA (`jit_compile=False`), and offload needs a host distinct from the
device, i.e. a GPU.

- On a GPU machine this script plans with offload allowed, rewrites the model
  and trains it, printing the measured device peak.
- On a CPU-only machine there is nothing to offload to, and TensorFlow's CPU
  allocator counts host and "device" together, so savings cannot be measured.
  The script then does what can be done: it plans with the `swap` planner,
  simulates the step (device and host memory, copy stalls at an assumed 16 GB/s
  and 5 TFLOP/s), draws the memory timeline with the offloaded tensors marked,
  and explains the figures.

    python examples/host_offload.py           # ResNet50, 96 px, batch 16
    python examples/host_offload.py --smoke   # a small CNN, 64 px, seconds

The full size takes about 20 seconds on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfremat  # noqa: E402
from tfremat.planners import min_feasible_budget  # noqa: E402


def small_cnn(size: int) -> keras.Model:
    inp = keras.Input((size, size, 3))
    x = inp
    for i in range(6):
        x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name=f"conv{i}")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(10, activation="softmax")(x), name="small_cnn")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--plot", default=None, help="memory timeline image "
                        "(default: memory_offload.png in a temp dir)")
    args = parser.parse_args(argv)
    if args.smoke:
        size, batch, model = 64, 16, small_cnn(64)
    else:
        size, batch = 96, 16
        model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                            classes=10)
    # Offload needs the step outside XLA (XLA ignores tf.device).
    model.compile(optimizer="sgd", loss="categorical_crossentropy", jit_compile=False)
    graph = tfremat.extract(model, batch_size=batch)
    plain = tfremat.simulate(graph)
    gpu = bool(tf.config.list_physical_devices("GPU"))

    # Offload only: the lowest device peak `swap` reaches, and a budget between it
    # and the plain step.
    budget = (plain.peak_bytes + min_feasible_budget(graph, "swap")) / 2 / 2**20
    plan = tfremat.plan(model, budget, graph=graph, planner="swap")
    est = tfremat.simulate(graph, plan)
    print(f"{model.name}, batch {batch}: plain step predicted {plain.peak_mb:.1f} MiB; "
          f"budget {budget:.1f} MiB")
    print(f"swap plan: {len(plan.offloaded)} tensors offloaded "
          f"({', '.join(o.tensor for o in plan.offloaded[:4])}"
          f"{', ...' if len(plan.offloaded) > 4 else ''})")
    print(f"predicted: device peak {est.peak_mb:.1f} MiB, host {est.host_peak_bytes / 2**20:.1f}"
          f" MiB, step {est.step_seconds * 1e3:.2f} ms vs {est.baseline_seconds * 1e3:.2f} ms "
          f"plain ({est.stall_seconds * 1e3:.2f} ms waiting for copies back)")
    path = args.plot or os.path.join(tempfile.mkdtemp(prefix="tfremat_offload_"),
                                     "memory_offload.png")
    print(f"memory timeline (offloaded tensors marked): {tfremat.plot_memory(plan, path)}")

    if not gpu:
        print("No GPU: host and device are the same memory here, so the saving cannot be "
              "measured; the figures above are the simulator's. On a GPU machine this "
              "script trains the rewritten model and measures GPU:0.")
        return
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * batch, size, size, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, 4 * batch), 10)
    smaller = tfremat.rewrite(model, plan)  # host "/CPU:0", compute the first GPU
    smaller.compile(optimizer="sgd", loss="categorical_crossentropy", jit_compile=False)
    smaller.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    measured = tfremat.measure_peak(smaller, batch_size=batch) / 2**20
    print(f"measured on GPU:0: {measured:.1f} MiB (budget {budget:.1f} MiB)")


if __name__ == "__main__":
    main()
