"""A training process with the Planner is SIGKILLed in the middle of an epoch and
restarted: `keras.callbacks.BackupAndRestore` (save_freq in steps) resumes from
its backup, the Planner plans again and applies the same plan.

Keras 3.15's BackupAndRestore records the batch of a step backup but restores
only the epoch: the restarted fit runs the interrupted epoch again from its
first batch, starting from the mid-epoch weights. So a killed and restarted
run does not reproduce an uninterrupted one, with or without tfremat. What the
Planner must not change is that sequence: the killed-and-restarted run with
the Planner ends with the same weights as the same kill and restart without it.
Four fresh processes, about 40 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.callbacks.backup_worker import EPOCHS, SAVE_FREQ, STEPS
from tests.rewriter.rewrite_helpers import rel_error

ROOT = pathlib.Path(__file__).parent.parent.parent
KILL_AT = STEPS + 3  # epoch 2, batch 3: one backup (step 8) in that epoch


def run(directory: pathlib.Path, *flags: str) -> subprocess.Popen:
    # One inter-op thread: see test_final_weights_equal_the_same_kill_and_restart_...
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3",
           "TF_NUM_INTEROP_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.callbacks.backup_worker",
                             str(directory), *flags], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def weights(path: pathlib.Path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Kill then restart, with and without the Planner (the two chains in parallel)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("planned", "plain")}
    flags = {"planned": ["--planner"], "plain": []}
    results: dict[str, dict] = {name: {} for name in dirs}
    for phase, extra in (("killed", ["--kill-at", str(KILL_AT)]), ("restarted", [])):
        procs = {name: run(dirs[name], *flags[name], *extra) for name in dirs}
        for name, proc in procs.items():
            log = proc.communicate(timeout=300)[0]
            results[name][phase] = proc.returncode
            results[name][f"{phase}_log"] = log
            if phase == "restarted":
                assert proc.returncode == 0, log[-4000:]
                results[name]["epochs_run"] = json.loads(log.strip().splitlines()[-1])[
                    "epochs_run"]
            if phase == "killed":
                results[name]["backup_step"] = weights(dirs[name] / "backup_step.npz")
                if name == "planned":
                    results[name]["plan_killed"] = json.loads(
                        (dirs[name] / "plan.json").read_text())
        if phase == "restarted":
            for name in dirs:
                results[name]["resumed"] = weights(dirs[name] / "resumed.npz")
                results[name]["final"] = weights(dirs[name] / "final.npz")
    results["planned"]["plan_restarted"] = json.loads(
        (dirs["planned"] / "plan.json").read_text())
    return results


def test_the_process_was_really_killed(runs):
    for name in ("planned", "plain"):
        assert runs[name]["killed"] == -signal.SIGKILL, runs[name]["killed_log"][-2000:]


def test_training_resumes_from_the_backup_in_the_interrupted_epoch(runs):
    for name in ("planned", "plain"):
        for a, b in zip(runs[name]["resumed"], runs[name]["backup_step"]):
            np.testing.assert_array_equal(a, b)
        # Killed in epoch 2 of 3: the restarted fit runs epochs 2 and 3.
        assert runs[name]["epochs_run"] == EPOCHS - KILL_AT // STEPS
    assert KILL_AT % SAVE_FREQ and KILL_AT // SAVE_FREQ * SAVE_FREQ > STEPS  # mid-epoch


def test_the_plan_is_applied_again_after_the_restart(runs):
    planned = runs["planned"]
    assert planned["plan_restarted"] and planned["plan_restarted"] == planned["plan_killed"]


def test_final_weights_equal_the_same_kill_and_restart_without_the_planner(runs):
    """Within 1e-12 of the weights' global norm: the model trains in float64
    (`backup_worker`), where the rewritten graph's other summation order moves
    a value by about 1e-16 of itself (1.1e-16 here). In float32 that order
    moved a bias before BatchNorm by 10% of itself, and such a difference can
    flip a ReLU's input across zero, which moves the weights by a learning
    step's size: on an AMD EPYC the planned run ended 7.2e-5 away with its
    optimizer state restored to 9.3e-10, past this test's 1e-6 then. The
    processes run on one inter-op thread, so each run is bit-reproducible."""
    planned, plain = runs["planned"]["final"], runs["plain"]["final"]
    assert [a.shape for a in planned] == [b.shape for b in plain]
    error = rel_error(plain, planned)
    assert error <= 1e-12, f"weights differ by {error:.2e}"
    moved = max(np.max(np.abs(a - b)) for a, b in zip(runs["plain"]["final"],
                                                        runs["plain"]["backup_step"]))
    assert moved > 1e-4  # training went on after the restart
