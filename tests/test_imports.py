"""Every module imports alone, no two modules import each other (directly or round a
longer circle), and dependencies point one way.

Each module is imported in a fresh interpreter, so a cycle that breaks loading cannot hide
behind an import order that happens to work. Circles are read from the source as well,
since most never break loading: every `import` / `from ... import` of a quasar module
counts, at module level and inside functions alike. A lazy import (inside a function) runs
only after both modules have loaded, so it never fails, but it still ties the two modules
together: the one circle this test was written for (`bench/openvino.py` imported
`bench/peers.py` at load, and `peers.py` imported `openvino.py` in a function) was of that
kind. The lower layers must not pull in the upper ones: `models` and `data` never load
`quant`, `speculative`, `api` or the front ends.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import quasar

# (`quasar.__main__` runs the CLI when imported; it is `python -m quasar`, not a module to import)
MODULES = sorted(m.name for m in pkgutil.walk_packages(quasar.__path__, "quasar.") if m.name != "quasar.__main__")
# layer -> packages it must never load
FRONT_ENDS = ("quasar.api", "quasar.bench", "quasar.eval", "quasar.server", "quasar.cli")
FORBIDDEN = {
    "quasar.cache": ("quasar.models", "quasar.data", "quasar.kernels", "quasar.runtime", "quasar.quant",
                     "quasar.engine", "quasar.speculative", *FRONT_ENDS),
    "quasar.data": ("quasar.models", "quasar.kernels", "quasar.runtime", "quasar.quant", "quasar.engine",
                    "quasar.speculative", *FRONT_ENDS),
    "quasar.models": ("quasar.kernels", "quasar.runtime", "quasar.quant", "quasar.engine", "quasar.speculative",
                      *FRONT_ENDS),
    "quasar.kernels": ("quasar.models", "quasar.runtime", "quasar.quant", "quasar.engine", "quasar.speculative",
                       *FRONT_ENDS),
    "quasar.runtime": ("quasar.quant", "quasar.engine", "quasar.speculative", *FRONT_ENDS),
    "quasar.quant": ("quasar.engine", "quasar.speculative", *FRONT_ENDS),
    "quasar.speculative": ("quasar.kernels", "quasar.runtime", "quasar.quant", "quasar.engine", *FRONT_ENDS),
    "quasar.engine": FRONT_ENDS,
    "quasar.api": ("quasar.bench", "quasar.eval", "quasar.server", "quasar.cli"),
    "quasar.bench": ("quasar.cli",),
    "quasar.eval": ("quasar.cli",),
    "quasar.server": ("quasar.cli",),
}
PROBE = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
         "print(json.dumps(sorted(m for m in sys.modules if m.startswith('quasar'))))")


def _import_alone(name: str) -> tuple[str, int, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, name], capture_output=True, text=True, timeout=120)
    return name, out.returncode, out.stdout if out.returncode == 0 else out.stderr


@pytest.fixture(scope="module")
def imported() -> dict[str, list[str]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_import_alone, MODULES))
    failed = {name: err.strip().splitlines()[-1] for name, rc, err in results if rc != 0}
    assert not failed, f"modules that do not import alone: {failed}"
    return {name: json.loads(out) for name, _, out in results}


def test_walks_the_whole_package():
    assert {"quasar.models.llama", "quasar.runtime.w8a8", "quasar.speculative.generate", "quasar.api",
            "quasar.cli"} <= set(MODULES)


def test_every_module_imports_alone(imported):
    assert set(imported) == set(MODULES)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(imported, layer):
    for name, loaded in imported.items():
        if name == layer or name.startswith(layer + "."):
            bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN[layer])]
            assert not bad, f"{name} loads {bad}"


# --------------------------------------------------------------------------- circles


def _module_files() -> dict[str, Path]:
    """quasar module name -> its file (a package is its __init__.py)."""
    root = Path(quasar.__file__).parent
    files = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The quasar modules `module` imports anywhere in its source (functions included): for
    `from X import Y`, X.Y when that is a module, else X."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                if target in known:
                    found.add(target)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    files = _module_files()
    return {m: _imported(m, path, set(files)) for m, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert set(graph) >= set(MODULES)
    assert "quasar.bench.engine" in graph["quasar.bench.openvino"]  # module level, from X import Y
    assert "quasar.api" in graph["quasar.bench.runner"]  # inside run_bench
    assert "quasar.kernels.ext" in graph["quasar.runtime.w8a8_backends"]  # from a package import a module


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert circles(import_graph()) == []
