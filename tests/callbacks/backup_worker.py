"""One training process for tests/callbacks/test_planner_faults.py.

`python -m tests.callbacks.backup_worker DIR [--planner] [--kill-at N]` trains a
small CNN in float64 with `keras.callbacks.BackupAndRestore(DIR/backup, save_freq=SAVE_FREQ)`
(and a `tfremat.Planner` under 70% of the predicted plain peak with
`--planner`). With `--kill-at N` the process SIGKILLs itself right after global
step N. It writes into DIR: `backup_step.npz` (weights at the last backup
before the kill), `resumed.npz` (weights once BackupAndRestore restored them),
`plan.json` (the plan's segments) and `final.npz` (weights after training).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfremat  # noqa: E402
from tfremat.demo import resnet_style  # noqa: E402

EPOCHS, STEPS, BATCH, SAVE_FREQ = 3, 6, 8, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--planner", action="store_true")
    parser.add_argument("--kill-at", type=int)
    args = parser.parse_args()
    # In float64 the rewritten graph's other summation order rounds 1e-16 of a
    # value away, too little to move a ReLU's input across zero: the runs
    # with and without the Planner stay apart only by that rounding.
    keras.config.set_floatx("float64")
    keras.utils.set_random_seed(0)
    model = resnet_style(image_size=32, width=8, blocks=(2,))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss="categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * STEPS, 32, 32, 3))
    y = keras.utils.to_categorical(rng.integers(0, 10, BATCH * STEPS), 10)
    out = args.dir

    class Probe(keras.callbacks.Callback):
        """Records weights at restore time and at backups; kills the process."""

        def __init__(self) -> None:
            super().__init__()
            self.step = 0

        def on_train_begin(self, logs: dict | None = None) -> None:
            np.savez(os.path.join(out, "resumed.npz"), *self.model.get_weights())

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.step += 1
            if planner is not None and self.step == 1:
                with open(os.path.join(out, "plan.json"), "w") as f:
                    json.dump([s.nodes for s in planner.plan.segments], f)
            if args.kill_at and self.step == (args.kill_at // SAVE_FREQ) * SAVE_FREQ:
                np.savez(os.path.join(out, "backup_step.npz"), *self.model.get_weights())
            if self.step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    planner = None
    if args.planner:
        # Midway between the lowest feasible budget and the plain peak (the
        # convolutions' gradients' scratch, sized by the CPU's cache, is most of it).
        graph = tfremat.extract(model, batch_size=BATCH)
        try:
            tfremat.plan(model, 0.01, graph=graph)
        except tfremat.BudgetError as refused:
            budget = (tfremat.simulate(graph).peak_mb + refused.min_budget_mb) / 2
        # Unmeasured planning is deterministic: the restarted fit must apply the
        # killed one's plan again (a measured choice may differ by the spread).
        planner = tfremat.Planner(budget, verbose=0, replan=False, measure=False)
    backup = keras.callbacks.BackupAndRestore(os.path.join(out, "backup"),
                                              save_freq=SAVE_FREQ)
    callbacks = [c for c in (planner, backup, Probe()) if c is not None]
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=callbacks)
    np.savez(os.path.join(out, "final.npz"), *model.get_weights())
    print(json.dumps({"epochs_run": len(history.history["loss"])}))


if __name__ == "__main__":
    main()
