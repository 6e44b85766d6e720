"""The package's shape: imports point one way (down the layers listed in accel/__init__),
there is no import cycle (both read statically from the import graph), every module imports in
a fresh interpreter (in two orders), the library never calls setup(), the built wheel carries
every subpackage, and every benchmark runs in one process. Modules are cut by idea, not by
length: there is no line limit."""

import ast
import pkgutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import accel
from accel.procs import run_python

ROOT = Path(accel.__file__).parent
# layer of each module, by the longest matching prefix; a module may import only from a layer
# at or below its own (plumbing is 0)
LAYERS = {
    "accel": 0, "accel.checks": 0, "accel.procs": 0, "accel.timing": 0, "accel.datasets": 0,
    "accel.models": 0, "accel.training": 0, "accel.viz": 0,
    "accel.costmodel": 1,
    "accel.devices": 2, "accel.kernels": 2, "accel.placement": 2,
    "accel.profile": 2,
    "accel.memory": 3,
    "accel.collectives": 4,
    "accel.parallel": 5,
    "accel.distributed": 6,
    "accel.course": 7,
    "accel.__main__": 8,
}


def modules() -> list[str]:
    names = ["accel"]
    for info in pkgutil.walk_packages([str(ROOT)], prefix="accel."):
        names.append(info.name)
    return sorted(names)


def layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[best]


def path_of(name: str) -> Path:
    rel = Path(*name.split(".")[1:])
    package = ROOT / rel / "__init__.py"
    return package if package.exists() else ROOT / rel.with_suffix(".py")


def imports_of(name: str) -> set[str]:
    """accel modules that ``name`` imports anywhere in its code (functions included)."""
    known = set(modules())
    found = set()
    tree = ast.parse(path_of(name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("accel")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("accel"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m != name}


def test_the_layer_table_covers_every_module():
    assert all(layer(m) >= 0 for m in modules())
    assert "accel.parallel.data" in modules() and "accel.course.registry" in modules()


def test_imports_point_down_the_layers():
    wrong = [(m, i) for m in modules() for i in imports_of(m)
             if i != "accel" and layer(i) > layer(m)]
    assert wrong == [], f"modules importing from a layer above their own: {wrong}"


def test_no_import_cycle():
    graph = {m: imports_of(m) - {"accel"} for m in modules()}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(
                    stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_library_hygiene():
    """No setup() call outside the course layer, no private names imported across modules, no
    imports below code, an __all__ in every module."""
    for m in modules():
        text = path_of(m).read_text()
        tree = ast.parse(text)
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in ast.walk(tree) if isinstance(n, ast.Call)}
        if layer(m) < LAYERS["accel.course"] and m != "accel.devices":
            assert "setup" not in calls, f"{m} calls setup(); take devices as arguments"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accel"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{m} imports private {private} from {node.module}"
        assert "noqa: E402" not in text, m
        if not path_of(m).name == "__init__.py" and m != "accel.__main__":
            assert "__all__" in text, f"{m} has no __all__"


IMPORT_ALL = """import importlib
for name in {names!r}:
    importlib.import_module(name)  # an error fails the child, its traceback names the module
print("imported", len({names!r}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_every_module_imports_in_a_fresh_interpreter(order):
    """One fresh interpreter imports every module in turn: an error at import time fails here.
    Sorted, parents come before their children; reversed, the top of the layers comes first
    and pulls in what it needs (a module that only works after another one was imported fails
    in one of the two orders; cycles are caught statically above)."""
    names = modules() if order == "sorted" else modules()[::-1]
    out = run_python(IMPORT_ALL.format(names=names), timeout=300)
    assert out.strip().splitlines()[-1] == f"imported {len(names)}"


@pytest.mark.slow
def test_the_built_wheel_carries_every_module(tmp_path):
    """``pip install .`` must install the subpackages too (an explicit ``packages = ["accel"]``
    would silently leave them out, and the editable install of ``make test`` would hide it)."""
    project = ROOT.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(project)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("accel-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {n for n in zf.namelist() if n.endswith((".py", ".json"))}
    expected = {str(path_of(m).relative_to(project)) for m in modules()}
    # the measured hardware records hardware.achievable reads (package data)
    expected |= {str(p.relative_to(project)) for p in (ROOT / "costmodel" / "records").glob(
        "*.json")}
    assert any(n.endswith(".json") for n in expected)
    assert expected <= in_wheel, sorted(expected - in_wheel)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    code = ("import importlib, sys\n"
            f"sys.path.insert(0, {str(target)!r})\n"
            f"for name in {modules()!r}:\n"
            "    module = importlib.import_module(name)\n"
            f"    assert module.__file__.startswith({str(target)!r}), module.__file__\n"
            "print('ok')\n")
    assert run_python(code, timeout=300).strip().endswith("ok")




def test_library_tests_never_import_the_course():
    """The library is checked on its own: only tests/course and the chapters' own checks
    may import the course package or the command line (which imports it)."""
    import re
    from pathlib import Path

    here = Path(__file__).parent
    course_side = {here / "test_chapters.py", *here.glob("course/*.py")}
    pattern = re.compile(r"^\s*(from accel\.course\b|import accel\.course\b|"
                         r"from accel import (.*\b)?(course|__main__)\b)", re.M)
    offenders = [str(p.relative_to(here)) for p in here.rglob("*.py")
                 if p not in course_side and pattern.search(p.read_text())]
    assert offenders == []
