"""The README's Python snippet runs as written, on a machine without Graphviz."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_usage_snippet_runs_without_graphviz(tmp_path):
    blocks = readme_python_blocks()
    assert len(blocks) == 1, "test every Python block of the README"
    checks = (
        "\nassert len(history.history['peak_memory_mb']) == 2\n"
        "assert not plan.is_empty and smaller is not model\n"
        "assert (pathlib.Path('plan.dot')).read_text().startswith('digraph')\n"
        "print('snippet ok')\n")
    code = "import pathlib, warnings\nwarnings.simplefilter('ignore')\n" + blocks[0] + checks
    env = {"PATH": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND": "tensorflow",
           "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert "snippet ok" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
