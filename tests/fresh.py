"""Runs a script in a fresh Python process: the allocator's peak is process-wide,
so a figure compared with a prediction must not count what earlier tests left."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_fresh(script: str, timeout: float = 600, **env_vars: str) -> dict:
    """Runs `script` (which prints one JSON object last), with `env_vars` set in
    its environment, and returns that object."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT), **env_vars}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
