"""`tfremat demo`: train a ResNet-style model under a budget its plain step exceeds."""

from __future__ import annotations

import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfremat.api import check_positive
from tfremat.callbacks import Planner
from tfremat.backend import device_name
from tfremat.core import check_count


def resnet_style(image_size: int = 64, width: int = 32, blocks: tuple[int, ...] = (2, 2, 2),
                 classes: int = 10) -> keras.Model:
    """A small residual CNN (conv-BN-ReLU blocks with identity skips)."""
    inp = keras.Input((image_size, image_size, 3), name="image")
    x = keras.layers.Conv2D(width, 3, padding="same", name="stem_conv")(inp)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    for stage, count in enumerate(blocks):
        filters = width * 2**stage
        for b in range(count):
            name = f"s{stage}b{b}"
            stride = 2 if b == 0 and stage > 0 else 1
            shortcut = x
            if stride != 1 or x.shape[-1] != filters:
                shortcut = keras.layers.Conv2D(filters, 1, strides=stride,
                                               name=f"{name}_proj")(x)
            y = keras.layers.Conv2D(filters, 3, strides=stride, padding="same",
                                    name=f"{name}_conv1")(x)
            y = keras.layers.BatchNormalization(name=f"{name}_bn1")(y)
            y = keras.layers.ReLU(name=f"{name}_relu1")(y)
            y = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_conv2")(y)
            y = keras.layers.BatchNormalization(name=f"{name}_bn2")(y)
            x = keras.layers.Add(name=f"{name}_add")([shortcut, y])
            x = keras.layers.ReLU(name=f"{name}_out")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    out = keras.layers.Dense(classes, activation="softmax", name="head")(x)
    return keras.Model(inp, out, name="resnet_style")


def _compiled(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = resnet_style()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="categorical_crossentropy")
    return model


def _data(batch_size: int, steps: int) -> tf.data.Dataset:
    """Synthetic images and one-hot labels, batched, without tf.data's autotuning.

    Releasing an epoch's iterator waits for its autotuning thread, which took
    10-39 s at the start of epoch 2 when the iterator had lived through the
    Planner's planning (docs/troubleshooting.md, "The second epoch starts late").
    """
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch_size * steps, 64, 64, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, batch_size * steps), 10)
    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size).with_options(options)


def _seconds_per_step(model: keras.Model, data: tf.data.Dataset,
                      callbacks: list[keras.callbacks.Callback] = ()) -> float:
    """Mean wall time of a fit's steps after the first (tracing, planning)."""
    timer = _StepTimer()
    model.fit(data, verbose=0, shuffle=False, callbacks=[timer, *callbacks])
    return timer.seconds_per_step


def run_demo(*, batch_size: int = 32, steps: int = 8, epochs: int = 2,
             budget_fraction: float = 0.75, export: str | None = "tfremat_plan.png",
             plot: str | None = "tfremat_memory.png", verbose: int = 1) -> dict[str, Any]:
    """Trains a ResNet-style model on synthetic data under a budget its plain
    step exceeds, and compares measured peaks and step times.

    Args:
        batch_size: Training batch size.
        steps: Steps per epoch.
        epochs: Epochs trained with the budget.
        budget_fraction: Budget as a fraction of the measured plain peak.
        export: Path of the plan picture, or None.
        plot: Path of the memory timeline (predicted memory over one step,
            without and with the plan, budget and measured peaks), or None.
        verbose: 1 prints the plan summary and results.

    Returns:
        A dict of the measured figures.

    Raises:
        TypeError: a count that is not an integer, a budget fraction that is
            not a number.
        ValueError: a count below 1, a budget fraction not positive or not
            finite.
    """
    batch_size = check_count(batch_size, "batch_size")
    steps = check_count(steps, "steps")
    epochs = check_count(epochs, "epochs")
    budget_fraction = check_positive(budget_fraction, "budget_fraction", "times the plain peak")
    data = _data(batch_size, steps)
    # The plain step, measured inside fit as the budgeted run will be (on CPU the
    # allocator also holds the input pipeline's batches).
    plain = _compiled(seed=1)
    watch = Planner(1e9, verbose=0)  # no rewrite: it only measures
    t_plain = _seconds_per_step(plain, data, [watch])
    plain_peak = watch.epoch_peaks_mb[-1]
    budget_mb = round(plain_peak * budget_fraction)
    if verbose:
        print(f"Plain training of {plain.name}, batch {batch_size}: measured peak "
              f"{plain_peak:.1f} MiB on {device_name()}. Budget: {budget_mb} MiB.")
    planned = _compiled(seed=1)
    planner = Planner(budget_mb, verbose=verbose, export=export, plot=plot)
    # Before the planner: a step's time ends before a re-plan's trials begin.
    timer = _StepTimer(planner)
    history = planned.fit(data, epochs=epochs, verbose=verbose, shuffle=False,
                          callbacks=[timer, planner])
    # Step times interleaved in one process: plain, planned, plain.
    t_plain = (t_plain + _seconds_per_step(plain, data)) / 2
    t_planned = timer.seconds_per_step
    result = {
        "plain_peak_mb": plain_peak,
        "budget_mb": budget_mb,
        "peak_memory_mb": history.history["peak_memory_mb"],
        "held_memory_mb": history.history["held_memory_mb"],
        "plan_peak_mb": planner.plan_peak_mb,
        "predicted_peak_mb": history.history["predicted_peak_mb"][-1],
        "loss": history.history["loss"],
        "step_time_ratio": t_planned / t_plain,
        "plan_picture": planner.picture,
        "memory_timeline": planner.timeline,
    }
    if verbose:
        peaks = ", ".join(f"{p:.1f}" for p in result["peak_memory_mb"])
        held = ", ".join(f"{h:.1f}" for h in result["held_memory_mb"])
        print(f"\nMeasured peak per epoch with tfremat: {peaks} MiB (budget {budget_mb} MiB, "
              f"plain {plain_peak:.1f} MiB). Of it, {held} MiB were held beside the model "
              "(on CPU, the input pipeline's arrays share the allocator).")
        if planner.plan_peak_mb is not None:
            print(f"Measured peak with the final plan (its first step left out): "
                  f"{planner.plan_peak_mb:.1f} MiB"
                  + (" - within the budget." if planner.plan_peak_mb <= budget_mb
                     else " - over the budget."))
        print(f"Step time with the final plan (its first step left out): "
              f"{result['step_time_ratio']:.2f}x the plain step.")
        if planner.timeline:
            print(f"Memory timeline: {planner.timeline}")
        if planner.picture:
            print(f"Plan picture: {planner.picture}")
    return result


class _StepTimer(keras.callbacks.Callback):
    """Mean wall time of the steps run with the last plan, its first step left
    out (it traces the rewritten step; the fit's first step also plans).

    Args:
        planner: The fit's Planner, whose plan each step runs with (it may
            re-plan); None when the fit has no rewriting Planner.
    """

    def __init__(self, planner: Planner | None = None):
        super().__init__()
        self.planner = planner

    def on_train_begin(self, logs=None):
        self.steps: list[tuple[Any, float]] = []  # (plan at the step's start, seconds)

    def on_train_batch_begin(self, batch, logs=None):
        self.plan = self.planner.plan if self.planner is not None else None
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append((self.plan, time.perf_counter() - self.started))

    @property
    def seconds_per_step(self) -> float:
        if not self.steps:
            return float("nan")
        last = self.steps[-1][0]
        times = [t for plan, t in self.steps if plan is last][1:]
        return float(np.mean(times)) if times else float("nan")
