"""The docs site builds with `mkdocs build --strict`, and the API page covers every
public name, each with an example in its docstring."""

import importlib
import os
import importlib.util
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import tfremat

ROOT = pathlib.Path(__file__).parent.parent

def api_entries() -> dict[str, object]:
    """`::: module.name` entries of docs/api.md -> the objects they name."""
    found = {}
    for path in re.findall(r"^::: ([\w.]+)$", (ROOT / "docs" / "api.md").read_text(), re.M):
        module, name = path.rsplit(".", 1)
        found[name] = getattr(importlib.import_module(module), name)
    return found


def test_every_public_name_has_an_api_entry():
    entries = api_entries()
    for name in tfremat.__all__:
        assert name in entries, f"docs/api.md has no entry for tfremat.{name}"
        assert entries[name] is getattr(tfremat, name), name


@pytest.mark.parametrize("name", sorted(tfremat.__all__))
def test_public_docstrings_have_an_example(name):
    doc = inspect.getdoc(getattr(tfremat, name)) or ""
    assert re.search(r"^Example:?$", doc, re.M), f"tfremat.{name} has no Example section"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None
                    or importlib.util.find_spec("mkdocstrings") is None,
                    reason="mkdocs and mkdocstrings are not installed: "
                           "pip install -e '.[docs]' (the test extra installs them)")
def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    api = (tmp_path / "api" / "index.html").read_text()
    for name in tfremat.__all__:
        assert f'.{name}"' in api, f"the built API page has no anchor for {name}"
    assert (tmp_path / "images" / "memory_timeline.png").exists()
