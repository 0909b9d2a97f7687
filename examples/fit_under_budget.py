"""Train ResNet50 on a tf.data pipeline under a device memory budget.

The `Planner` callback traces one training step at the first batch, plans what
to recompute so the step fits the budget, and trains this fit with the plan.
Each epoch's measured device peak lands in the History beside the prediction.

    python examples/fit_under_budget.py                   # 96 px, batch 16, budget 250 MiB
    python examples/fit_under_budget.py --budget-mb 200
    python examples/fit_under_budget.py --smoke           # 32 px, batch 2, seconds

The full size takes about a minute on 2 CPU cores; --smoke, seconds.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfremat  # noqa: E402
from tfremat.planners import min_feasible_budget  # noqa: E402


def dataset(image_size: int, batch_size: int, steps: int, classes: int) -> tf.data.Dataset:
    """Synthetic images through a typical input pipeline: augment, batch, prefetch."""
    images = tf.random.stateless_uniform((batch_size * steps, image_size, image_size, 3),
                                         seed=(0, 1))
    labels = tf.random.stateless_uniform((batch_size * steps,), seed=(0, 2), maxval=classes,
                                         dtype=tf.int32)
    ds = tf.data.Dataset.from_tensor_slices((images, labels))
    ds = ds.map(lambda x, y: (tf.image.random_flip_left_right(x), y),
                num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--budget-mb", type=float, default=None,
                        help="device budget in MiB (default: 250; with --smoke, halfway "
                             "between the plain peak and chen-sqrt's lowest)")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    image_size, batch, steps = (32, 2, 2) if args.smoke else (96, 16, 8)

    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(image_size,) * 2 + (3,),
                                        classes=10)
    model.compile(optimizer=keras.optimizers.SGD(1e-3),
                  loss="sparse_categorical_crossentropy")
    ds = dataset(image_size, batch, steps, classes=10)

    budget = args.budget_mb
    if budget is None and args.smoke:
        # Tiny inputs: halfway between the plain step's predicted peak and the
        # lowest peak chen-sqrt reaches.
        graph = tfremat.extract(model, sample=ds)
        budget = (tfremat.simulate(graph).peak_bytes
                  + min_feasible_budget(graph, "chen-sqrt")) / 2 / 2**20
    budget = budget or 250.0

    planner = tfremat.Planner(budget, verbose=0 if args.smoke else 1)
    # The dataset is the whole pipeline (shuffle it there): fit must not shuffle.
    history = model.fit(ds, epochs=args.epochs, verbose=0 if args.smoke else 2,
                        shuffle=False, callbacks=[planner])

    # What the History holds: the loss and, per epoch, measured and predicted peaks,
    # and what was held beside the model (on CPU, the input pipeline's tensors).
    # An epoch's peak includes its first step, which traces the step and makes
    # first-use allocations; `plan_peak_mb` leaves that step out.
    plan = planner.plan
    print(f"ResNet50 {image_size}px, batch {batch}: plain step predicted "
          f"{tfremat.simulate(planner.graph).peak_mb:.1f} MiB; budget {budget:.1f} MiB, "
          f"plan by {plan.planner} with {len(plan.segments)} segments "
          f"(+{plan.estimates.overhead:.0%} compute); re-planned {planner.replans}x")
    for epoch in range(args.epochs):
        print(f"epoch {epoch}: loss {history.history['loss'][epoch]:.3f}, measured peak "
              f"{history.history['peak_memory_mb'][epoch]:.1f} MiB (of it "
              f"{history.history['held_memory_mb'][epoch]:.1f} held beside the model), "
              f"predicted {history.history['predicted_peak_mb'][epoch]:.1f} MiB")
    if planner.plan_peak_mb is not None:
        verdict = "within" if planner.plan_peak_mb <= budget else "OVER"
        print(f"final plan, its first step left out: measured peak "
              f"{planner.plan_peak_mb:.1f} MiB, {verdict} the budget")


if __name__ == "__main__":
    main()
