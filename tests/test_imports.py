"""The package's layers point one way (kernels <- loader <- ops <- torch layer <- nn/optim/train,
with the public functions of ``cukit/_api.py`` above ops and the torch layer): no import cycles,
static or at run time.

- statically: every ``import`` / ``from ... import`` in every module (function bodies included)
  and every ``importlib.import_module("<constant>")`` is an edge; the graph has no cycle;
- at run time: each module of the package imports alone in a fresh interpreter (a cycle that the
  static graph misses shows up as a partially initialised module there).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source trees and the package each one installs as (pyproject's package-dir mapping).
TREES = {"cukit": ROOT / "cukit", "cukit.optim": ROOT / "optim"}


def package_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, root in TREES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p == "__pycache__" for p in parts):
                continue
            mods[".".join([pkg, *parts])] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package modules `module` imports (explicitly; a submodule's import of its parent
    package's ``__init__`` is implicit in Python and not counted)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` blocks never run
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        for t in targets:
            if t.startswith("cukit"):
                r = _resolve(t, mods)
                if r is not None and r != module:
                    out.add(r)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state:
                cyc = visit(m)
                if cyc:
                    return cyc
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            cyc = visit(n)
            if cyc:
                return cyc
    return None


def test_the_package_has_no_import_cycles():
    mods = package_modules()
    assert "cukit.ops.matmul" in mods and "cukit.optim.adam" in mods and "cukit.torch._register" in mods
    graph = {m: import_edges(m, p, mods) for m, p in mods.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
    # the layering the cycle check protects
    ops = [m for m in mods if m.startswith("cukit.ops")]
    for m in ops:
        bad = {d for d in graph[m] if d.startswith(("cukit.torch", "cukit.nn", "cukit.optim", "cukit._api"))}
        assert not bad, f"{m} imports the layers above it: {sorted(bad)}"
    assert not {d for d in graph["cukit._runtime"] if d.startswith("cukit.ops")}, "the loader imports ops"


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.slow
def test_each_module_imports_alone_in_a_fresh_interpreter():
    mods = sorted(m for m in package_modules() if not m.endswith("__main__"))  # __main__ runs the CLI

    def run(m: str) -> tuple[str, int, str]:
        p = subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True, text=True, cwd=ROOT, timeout=300)
        return m, p.returncode, p.stderr[-800:]

    with ThreadPoolExecutor(max_workers=4) as ex:
        results = list(ex.map(run, mods))
    failed = [f"{m}: {err}" for m, rc, err in results if rc != 0]
    assert not failed, "\n".join(failed)
