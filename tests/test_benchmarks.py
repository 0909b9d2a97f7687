"""The benchmark scripts still import: they are run by hand, so a renamed module
would otherwise go unnoticed until someone reruns them."""

import importlib.util
import pathlib

import pytest

BENCHMARKS = sorted((pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_script_imports(path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.main)


def test_every_benchmark_is_checked():
    assert {p.name for p in BENCHMARKS} >= {"planners.py", "offload.py", "rewrite_memory.py",
                                            "simulator_fidelity.py"}
