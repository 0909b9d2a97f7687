"""A subclassed Keras model trained under a budget.

For a model written as a `keras.Model` subclass, tfremat plans over its direct
sublayers (here: the stem, each residual block and the head); their
connections come from the data flow of one traced step. Recompute segments are
runs of sublayers.

    python examples/subclassed_model.py           # 64 px, 6 blocks, batch 32
    python examples/subclassed_model.py --smoke   # 32 px, 3 blocks, seconds

The full size takes about 2 minutes on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfremat  # noqa: E402
from tfremat.planners import min_feasible_budget  # noqa: E402


class ResidualBlock(keras.layers.Layer):
    def __init__(self, filters: int, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = keras.layers.Conv2D(filters, 3, padding="same")
        self.bn1 = keras.layers.BatchNormalization()
        self.conv2 = keras.layers.Conv2D(filters, 3, padding="same")
        self.bn2 = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        y = keras.ops.relu(self.bn1(self.conv1(x), training=training))
        y = self.bn2(self.conv2(y), training=training)
        return keras.ops.relu(x + y)


class ResNetish(keras.Model):
    def __init__(self, blocks: int, filters: int, classes: int, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")
        self.blocks = [ResidualBlock(filters, name=f"block{i}") for i in range(blocks)]
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(classes, activation="softmax")

    def call(self, x, training=None):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(self.pool(x))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args(argv)
    size, blocks, batch, steps = (32, 3, 8, 2) if args.smoke else (64, 6, 32, 8)

    keras.utils.set_random_seed(0)
    model = ResNetish(blocks, filters=32, classes=10)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * steps, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, batch * steps)

    # A subclassed model has no declared inputs: build it by calling it, and trace
    # it with one real batch. (The Planner alone needs neither: it builds the model
    # from fit's first batch.)
    model(x[:1])
    graph = tfremat.extract(model, sample=(x[:batch], y[:batch]))
    print(f"{type(model).__name__}: the plan's units are its sublayers: "
          f"{[node.id for node in graph if not node.is_input]}")
    plain = tfremat.simulate(graph)
    # Halfway between the plain step and the lowest peak chen-sqrt reaches.
    budget = (plain.peak_bytes + min_feasible_budget(graph, "chen-sqrt")) / 2 / 2**20
    planner = tfremat.Planner(budget, verbose=0)
    history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[planner])
    print(f"budget {budget:.1f} MiB (plain step predicted {plain.peak_mb:.1f} MiB): plan by "
          f"{planner.plan.planner}, segments {[s.nodes for s in planner.plan.segments]}")
    print(f"loss {history.history['loss'][-1]:.3f}, measured peak "
          f"{history.history['peak_memory_mb'][-1]:.1f} MiB, predicted "
          f"{history.history['predicted_peak_mb'][-1]:.1f} MiB")
    # The epoch's peak includes its first step (tracing, first-use allocations).
    if planner.plan_peak_mb is not None:
        verdict = "within" if planner.plan_peak_mb <= budget else "OVER"
        print(f"final plan, its first step left out: measured peak "
              f"{planner.plan_peak_mb:.1f} MiB, {verdict} the budget; "
              f"re-planned {planner.replans}x")


if __name__ == "__main__":
    main()
