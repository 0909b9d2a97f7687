"""A U-Net for segmentation: skip connections, where the DP beats sqrt(n).

Chen et al.'s sqrt(n) planner cuts a network where a single tensor crosses
between two parts. A U-Net's skip connections carry every encoder level's
output across to the decoder, so such cuts are few and the segments uneven.
Kusumoto et al.'s DP (`approx-dp`) plans over all lower sets of the graph and,
at the same budget, needs less recomputation. This script compares the two
predictions, then trains under the budget with the DP's plan.

    python examples/unet_segmentation.py           # 128 px, 4 levels, batch 8
    python examples/unet_segmentation.py --smoke   # 32 px, 2 levels, seconds

The full size takes 1-2 minutes on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfremat  # noqa: E402
from tfremat.planners import min_feasible_budget  # noqa: E402


def conv_block(x, filters: int, name: str):
    for i in (1, 2):
        x = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_conv{i}")(x)
        x = keras.layers.BatchNormalization(name=f"{name}_bn{i}")(x)
        x = keras.layers.ReLU(name=f"{name}_relu{i}")(x)
    return x


def unet(size: int, levels: int, width: int, classes: int) -> keras.Model:
    inp = keras.Input((size, size, 3), name="image")
    x, skips = inp, []
    for level in range(levels):
        x = conv_block(x, width * 2**level, f"down{level}")
        skips.append(x)  # carried across to the decoder
        x = keras.layers.MaxPooling2D(name=f"pool{level}")(x)
    x = conv_block(x, width * 2**levels, "bottom")
    for level in reversed(range(levels)):
        x = keras.layers.Conv2DTranspose(width * 2**level, 2, strides=2,
                                         name=f"up{level}")(x)
        x = keras.layers.Concatenate(name=f"skip{level}")([x, skips[level]])
        x = conv_block(x, width * 2**level, f"dec{level}")
    out = keras.layers.Conv2D(classes, 1, activation="softmax", name="mask")(x)
    return keras.Model(inp, out, name="unet")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args(argv)
    size, levels, width, batch, steps = (32, 2, 8, 4, 2) if args.smoke else (128, 4, 16, 8, 8)
    classes = 3

    keras.utils.set_random_seed(0)
    model = unet(size, levels, width, classes)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * steps, size, size, 3)).astype("float32")
    y = rng.integers(0, classes, (batch * steps, size, size)).astype("int32")

    graph = tfremat.extract(model, batch_size=batch)
    plain = tfremat.simulate(graph)
    # The budget: the lowest peak sqrt(n) reaches. Both planners plan for it.
    budget = min_feasible_budget(graph, "chen-sqrt") / 2**20
    print(f"{model.name} {size}px, {levels} levels, batch {batch}: {len(graph)} layer calls, "
          f"plain step predicted {plain.peak_mb:.1f} MiB; budget {budget:.1f} MiB")
    plans = {}
    for planner in ("chen-sqrt", "approx-dp"):
        plans[planner] = tfremat.plan(model, budget, graph=graph, planner=planner)
        est = plans[planner].estimates
        print(f"  {planner:10s} {len(plans[planner].segments):3d} segments, predicted "
              f"{est.peak_mb:6.1f} MiB, +{est.overhead:.0%} compute")

    # Train with the DP's plan under the same budget (the Planner re-plans if the
    # measured peak comes out above it).
    planner = tfremat.Planner(budget, planner="approx-dp", verbose=0)
    history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[planner])
    print(f"trained with approx-dp: loss {history.history['loss'][-1]:.3f}, "
          f"re-planned {planner.replans}x; epoch's measured peak "
          f"{history.history['peak_memory_mb'][-1]:.1f} MiB (its first step traces and "
          "makes first-use allocations)")
    if planner.plan_peak_mb is not None:
        verdict = "within" if planner.plan_peak_mb <= budget else "OVER"
        print(f"final plan, its first step left out: measured peak "
              f"{planner.plan_peak_mb:.1f} MiB, {verdict} the budget of {budget:.1f} MiB")


if __name__ == "__main__":
    main()
