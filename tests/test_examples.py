"""Every script in examples/ runs with --smoke, in a fresh process, without Graphviz.

Each example is a separate process (some set up logical devices before
TensorFlow starts); together they take about 1-2 minutes of CPU time on 2 cores.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))

#: What each example must print, so a silent early exit cannot pass.
EXPECTED = {
    "distributed.py": "2 replicas on",
    "fit_under_budget.py": "epoch 1: loss",
    "host_offload.py": "memory timeline (offloaded tensors marked)",
    "inspect_a_plan.py": "JSON round trip",
    "multi_worker.py": "2 workers applied the same plan",
    "rewrite_and_save.py": "loaded in a fresh process: predictions match",
    "subclassed_model.py": "measured peak",
    "transformer_lm.py": "epoch 1: loss",
    "unet_segmentation.py": "trained with approx-dp",
}


def test_every_example_is_listed():
    assert set(EXAMPLES) == set(EXPECTED)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_with_smoke(name, tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.path.dirname(sys.executable)}",
           "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}  # no `dot` on PATH
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--smoke"],
                            cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert EXPECTED[name] in result.stdout, result.stdout[-2000:]
