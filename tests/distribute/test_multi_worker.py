"""tfremat.plan / tfremat.rewrite under MultiWorkerMirroredStrategy: 2 real worker
processes on localhost, a custom training loop (Keras 3's fit does not run
under the strategy, keras-team/keras#20585).

Each worker process has its own CPU allocator, so each worker's measured peak
is a real per-process measurement that can be checked against the budget.
About 35 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent.parent
# The workers measure their peaks (in the module's fixture, set up by the first test).
pytestmark = pytest.mark.alone


def example_launcher():
    """`run_workers` of examples/multi_worker.py (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("multi_worker_example",
                                                  ROOT / "examples" / "multi_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run_workers


@pytest.fixture(scope="module")
def workers(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("mwms")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    results = example_launcher()(
        [sys.executable, "-m", "tests.distribute.mwms_worker", "--out", str(out)],
        timeout=300, cwd=ROOT, env=env, stderr=subprocess.STDOUT)
    for code, log in results:
        assert code == 0, log[-4000:]
    return [json.loads((out / f"{i}.json").read_text()) for i in range(2)]


def test_the_plan_is_made_inside_the_scope_for_the_per_worker_batch(workers):
    for w in workers:
        assert w["workers"] == 2
        assert w["batch_shape"] == [[w["per_worker_batch"], 128]]
        assert w["predicted_plain_mb"] > w["budget_mb"] >= w["predicted_mb"]
        assert w["segments"] and w["recompute_layers"] == len(w["segments"])


def test_the_simulator_counts_the_gradient_all_reduce_pack_in_the_update(workers):
    # Keras's optimizer concatenates every gradient into one pack and
    # all-reduces it: the pack and its result coexist in the update, twice
    # the gradients' bytes.
    for w in workers:
        assert w["replicas"] == 2
        assert w["update_workspace_bytes"] >= 2 * w["gradient_bytes"] > 0


def test_every_worker_applies_the_same_plan(workers):
    first, second = workers
    assert first["fingerprint"] == second["fingerprint"] == first["plan_fingerprint"] \
        == second["plan_fingerprint"]
    assert first["segments"] == second["segments"]


def test_each_worker_measures_the_plan_below_its_plain_step(workers):
    """The plan is made by prediction alone (nothing measures in the scope),
    its order pinned by default in a multi-worker scope, for a budget of 70% of
    the predicted plain step, less a sixth. Measured per worker, the plan
    predicted at 6.1 MiB against a budget of 7.77 (docs/scaling.md): 5.65-7.71
    MiB on two CPUs, up to 7.93 with both workers on one CPU and two inter-op
    threads, 8.50-9.06 on one CPU and one thread, 9.58 in one CI run.
    The prediction meets the budget (the first test); the measured peak is
    checked against the worker's own plain step, which does not fit it."""
    for w in workers:
        figures = {k: w[k] for k in ("budget_mb", "predicted_mb", "planned_peak_mb",
                                     "plain_peak_mb", "cpus", "inter_op_threads")}
        assert w["pin_order"] is True, figures
        assert w["plain_peak_mb"] > w["budget_mb"], figures
        assert 0 < w["planned_peak_mb"] < w["plain_peak_mb"], figures


def test_training_matches_a_plain_two_worker_run(workers):
    for w in workers:
        assert w["weights_moved"] > 1e-4  # it trained
        assert w["relative_error"] <= 1e-6, w


def test_a_planner_for_fit_says_to_use_a_custom_loop(workers):
    for w in workers:
        assert "does not run under MultiWorkerMirroredStrategy" in w["fit_error"]
        assert "examples/multi_worker.py" in w["fit_error"]


def test_measuring_in_the_scope_says_to_plan_by_prediction(workers):
    for w in workers:
        assert "cannot measure inside the scope" in w["measure_error"], w
        assert "measure=False" in w["measure_error"]
