"""The floors of the package: imports run downwards, only through public faces,
and every module imports alone, first, in a fresh interpreter.

The floors (docs/how-it-works.md, "A map of the code"):

    0  core                 data, rules, errors; no TensorFlow, nothing else of tfremat
    1  backend              is TensorFlow there, and does Keras run on it?
    2  graph, simulation    the TensorFlow front end; prediction (no TensorFlow)
    3  planners, memory     planning (no TensorFlow); measurement
    4  rewriter, export,    Plan -> Keras model; pictures and text;
       plots                the memory timeline (matplotlib)
    5  api                  tfremat.plan, tfremat.rewrite
    6  callbacks            the Planner callback
    7  demo                 the demo's model and run
    8  cli                  the tfremat command
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PACKAGE = ROOT / "tfremat"

FLOORS = {
    "core": 0,
    "backend": 1,
    "graph": 2, "simulation": 2,
    "planners": 3, "memory": 3,
    "rewriter": 4, "export": 4, "plots": 4,
    "api": 5,
    "callbacks": 6,
    "demo": 7,
    "cli": 8,
}

#: Parts that must run without TensorFlow or Keras.
FRAMEWORK_FREE = ("core", "simulation", "planners", "export", "plots")


def modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


def unit_of(module: str) -> str | None:
    """The floor unit a module belongs to (None: the package's `__init__`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imports_of(module: str) -> list[tuple[str, list[str], bool]]:
    """`(imported module, names, at module level)` for every tfremat import,
    those inside functions included; `if TYPE_CHECKING:` blocks are skipped."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and \
                    child.module.startswith("tfremat"):
                found.append((child.module, [a.name for a in child.names], top))
            elif isinstance(child, ast.Import):
                found.extend((a.name, [], top) for a in child.names
                             if a.name.startswith("tfremat"))
            visit(child, top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, True)
    return found


def test_every_unit_has_a_floor():
    units = {unit_of(m) for m in modules()} - {None}
    assert units == set(FLOORS), "add new parts of the package to FLOORS and the docs map"


@pytest.mark.parametrize("module", modules())
def test_imports_run_downwards_through_public_faces(module):
    unit = unit_of(module)
    if unit is None:
        return  # the package's __init__ gathers the public names of every floor
    for target, names, _ in imports_of(module):
        if target == "tfremat":  # `from tfremat import x`: a submodule of the top
            assert all(unit_of(f"tfremat.{n}") in FLOORS for n in names), (module, names)
            for name in names:
                assert FLOORS[name] < FLOORS[unit], f"{module} imports tfremat.{name} (up)"
            continue
        other = unit_of(target)
        if other == unit:
            continue
        assert FLOORS[other] < FLOORS[unit], f"{module} imports {target}: not a lower floor"
        assert target == f"tfremat.{other}", (
            f"{module} reaches into {target}: use the public face tfremat.{other}")


def test_no_import_cycle_at_module_level():
    known = set(modules())
    graph: dict[str, set[str]] = {}
    for module in known:
        edges = set()
        for target, names, top in imports_of(module):
            if not top:
                continue
            submodules = {f"{target}.{n}" for n in names} & known
            edges |= submodules or {target}
        graph[module] = edges & known - {module}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if state.get(nxt) is None:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(known):
        if module not in state:
            visit(module, [module])


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module is imported first with no tfremat module loaded, then all the
    others; TensorFlow stays loaded between rounds (it is not what is tested)."""
    code = textwrap.dedent(f"""
        import importlib, sys, warnings
        warnings.simplefilter("ignore")
        import tensorflow, keras
        names = {modules()!r}
        failures = []
        for first in names:
            for key in [k for k in sys.modules if k == "tfremat" or k.startswith("tfremat.")]:
                del sys.modules[key]
            for name in [first] + [n for n in names if n != first]:
                try:
                    importlib.import_module(name)
                except Exception as e:
                    failures.append(f"{{first}} first, then {{name}}: {{e!r}}")
                    break
        print("\\n".join(failures))
        sys.exit(1 if failures else 0)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_framework_free_floors_import_without_tensorflow_or_keras():
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("tensorflow", "keras"):
                    raise ImportError(f"{{name}} is blocked")
        sys.meta_path.insert(0, Block())
        import tfremat
        for part in {FRAMEWORK_FREE!r}:
            __import__("tfremat." + part)
        assert not any(m.split(".")[0] in ("tensorflow", "keras") for m in sys.modules)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.stdout.strip() == "ok", result.stderr[-3000:]


def test_importing_tfremat_and_its_command_leaves_tensorflow_unimported():
    """`tfremat --help` answers in a second, and the command's TensorFlow log
    level (`TF_CPP_MIN_LOG_LEVEL`) is set before TensorFlow reads it."""
    code = textwrap.dedent("""
        import sys
        import tfremat
        from tfremat import cli
        try:
            cli.main(["--version"])
        except SystemExit:
            pass
        loaded = [m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras")]
        assert not loaded, loaded[:5]
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_no_public_name_hides_a_module():
    """`tfremat.rewrite` is a function: a module of that name would replace it
    as soon as someone imported the module (likewise in every public face)."""
    for face in ["tfremat"] + [f"tfremat.{u}" for u in FLOORS]:
        folder = PACKAGE.parent / face.replace(".", "/")
        if not folder.is_dir():
            continue
        submodules = {p.stem for p in folder.glob("*.py")} | {
            p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
        init = ast.parse((folder / "__init__.py").read_text())
        public = set()
        for node in ast.walk(init):
            if isinstance(node, ast.ImportFrom):
                public |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Assign) and any(
                    getattr(t, "id", None) == "_LAZY" for t in node.targets):
                public |= set(ast.literal_eval(node.value))
        assert not public & (submodules - {"__init__"}), (face, public & submodules)
