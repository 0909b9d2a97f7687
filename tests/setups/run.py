"""Runs one setup of tests/setups in this (fresh) process and writes what happened.

    python -m tests.setups.run SETUP plain OUT_DIR
    python -m tests.setups.run SETUP executor OUT_DIR
    python -m tests.setups.run SETUP planned OUT_DIR BUDGET_MB

Each fit is measured in a process of its own: TensorFlow's allocator statistics
are process-wide, so another model alive in the process would count in the peak.
`plain` fits without tfremat and measures the device peak of each epoch with its
own callback; `executor` the same with the step run by TensorFlow's executor
(`jit_compile=False`) whatever the setup compiled; `planned` fits with
`tfremat.Planner(BUDGET_MB)` and, when the budget cannot be met, fits again at the
minimum the BudgetError states; it records each epoch's peak and each step's, as
the Planner logs them.
Writes OUT_DIR/SETUP-MODE.json and OUT_DIR/SETUP-MODE.npz (the final weights).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# oneDNN's CPU allocator leaves small allocations out of its statistics (an RNN
# step measured 2 MiB with it, 22 MiB without); TensorFlow's own BFC allocator
# counts every allocation. Measure with that one.
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "1"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfremat  # noqa: E402
from tests.setups.models import build  # noqa: E402

EPOCHS = 2
DEVICE = "CPU:0"


class EpochPeaks(keras.callbacks.Callback):
    """The allocator's peak of each epoch, measured independently of tfremat."""

    def on_train_begin(self, logs=None):
        self.peaks: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        tf.config.experimental.reset_memory_stats(DEVICE)

    def on_epoch_end(self, epoch, logs=None):
        self.peaks.append(tf.config.experimental.get_memory_info(DEVICE)["peak"] / 2**20)


class StepPeaks(keras.callbacks.Callback):
    """The peak of each step as the Planner logs it (`log_batches=True`)."""

    def on_train_begin(self, logs=None):
        self.peaks: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.peaks.append(logs["peak_memory_mb"])


def fit(name: str, callbacks: list, executor: bool = False) -> keras.Model:
    setup = build(name)
    if executor:
        setup.model.jit_compile = False
    if setup.deterministic_ops:
        tf.config.experimental.enable_op_determinism()
    setup.model.fit(setup.x, setup.y, epochs=EPOCHS, verbose=0, shuffle=False,
                    callbacks=callbacks, **setup.fit_kwargs)
    return setup.model


def main(name: str, mode: str, out_dir: str, budget_mb: float | None = None) -> None:
    os.environ["TFREMAT_SETUP_TMP"] = out_dir
    peaks = EpochPeaks()
    result: dict = {"setup": name, "mode": mode}
    if mode in ("plain", "executor"):
        model = fit(name, [peaks], executor=mode == "executor")
        result["peaks_mb"] = peaks.peaks
    else:
        result["budget_mb"] = budget_mb
        steps = StepPeaks()
        try:
            planner = tfremat.Planner(budget_mb, verbose=0, log_batches=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = fit(name, [planner, steps])
        except tfremat.BudgetError as e:
            result["budget_error_min_mb"] = e.min_budget_mb
            result["budget_mb"] = budget_mb = e.min_budget_mb * 1.0001
            planner = tfremat.Planner(budget_mb, verbose=0, log_batches=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = fit(name, [planner, steps])
        result.update(
            peaks_mb=planner.epoch_peaks_mb, step_peaks_mb=steps.peaks,
            segments=len(planner.plan.segments),
            planner=planner.plan.planner, pinned=planner.plan.pin_order,
            replans=planner.replans,
            predicted_mb=planner.predicted_peak_mb,
            warnings=[str(w.message) for w in caught if "tfremat" in str(w.message)])
    np.savez(os.path.join(out_dir, f"{name}-{mode}.npz"),
             *[np.asarray(v.numpy(), dtype=np.float64) for v in model.variables])
    with open(os.path.join(out_dir, f"{name}-{mode}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], *(float(a) for a in sys.argv[4:]))
