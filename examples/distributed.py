"""Data-parallel training under a budget with tf.distribute.MirroredStrategy.

The budget is per device: each replica runs the step on its share of the
global batch, and the plan is made for that share. Build and compile the model
inside `strategy.scope()` and pass the Planner to `fit` as usual.

On a machine without GPUs this runs on two logical CPU devices. They share ONE
allocator, so the peak measured on `CPU:0` is both replicas together, about
twice the per-device budget: on CPU the measured figure cannot check the
budget, and re-planning is off here. On GPUs each device has its own memory and
the measured `GPU:0` peak is one replica's.

    python examples/distributed.py           # 64 px, global batch 64
    python examples/distributed.py --smoke   # 32 px, global batch 16, seconds

The full size takes about a minute on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# Logical devices must be made before TensorFlow initialises its runtime.
if not tf.config.list_physical_devices("GPU"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfremat  # noqa: E402
from tfremat.planners import min_feasible_budget  # noqa: E402


def cnn(size: int, width: int) -> keras.Model:
    inp = keras.Input((size, size, 3))
    x = inp
    for i in range(6):
        x = keras.layers.Conv2D(width, 3, padding="same", name=f"conv{i}")(x)
        x = keras.layers.BatchNormalization(name=f"bn{i}")(x)
        x = keras.layers.ReLU(name=f"relu{i}")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(10, activation="softmax")(x), name="cnn")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args(argv)
    size, width, global_batch, steps = (32, 16, 16, 2) if args.smoke else (64, 32, 64, 8)

    gpus = tf.config.list_logical_devices("GPU")
    devices = [d.name for d in gpus] or ["/cpu:0", "/cpu:1"]
    strategy = tf.distribute.MirroredStrategy(devices)
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = cnn(size, width)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")

    # The per-device budget, from the prediction for one replica's share.
    graph = tfremat.extract(model, batch_size=global_batch // replicas)
    plain = tfremat.simulate(graph)
    # Halfway between the plain step and the lowest peak chen-sqrt reaches.
    budget = (plain.peak_bytes + min_feasible_budget(graph, "chen-sqrt")) / 2 / 2**20
    print(f"{replicas} replicas on {devices}; per-device batch {global_batch // replicas}; "
          f"plain step predicted {plain.peak_mb:.1f} MiB per device; budget {budget:.1f} MiB "
          "per device")

    rng = np.random.default_rng(0)
    x = rng.standard_normal((global_batch * steps, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, global_batch * steps)
    planner = tfremat.Planner(budget, verbose=0, replan=bool(gpus))
    with warnings.catch_warnings():
        if not gpus:  # the shared CPU allocator's sum is above the per-device budget
            warnings.filterwarnings("ignore", "tfremat: the measured peak")
        history = model.fit(x, y, batch_size=global_batch, epochs=1, verbose=0,
                            callbacks=[planner])
    where = "one device" if gpus else "both replicas: one shared CPU allocator"
    print(f"plan by {planner.plan.planner}: {len(planner.plan.segments)} segments, predicted "
          f"{planner.predicted_peak_mb:.1f} MiB per device; measured on {planner.device} "
          f"{history.history['peak_memory_mb'][-1]:.1f} MiB ({where}); loss "
          f"{history.history['loss'][-1]:.3f}")


if __name__ == "__main__":
    main()
