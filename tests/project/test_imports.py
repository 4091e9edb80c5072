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

Imports belong at the top of a module: at most MAX_LAZY_IMPORTS sit inside functions, each
saying why on its line (`# lazy: reason`). The `quasar` command's parser loads no torch;
each command's handler module is imported when the command runs.
"""

from __future__ import annotations

import argparse
import ast
import json
import pkgutil
import re
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


# --------------------------------------------------------------------------- imports inside functions

MAX_LAZY_IMPORTS = 40  # across quasar/
LAZY_REASON = re.compile(r"# lazy: \S")  # the trailing comment that says why, on the import's first line


def lazy_imports(source: str) -> list[tuple[int, str]]:
    """(line number, first line) of every import statement inside a function of `source`;
    one in a nested function counts once."""
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child.lineno, lines[child.lineno - 1]))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return found


def _package_lazy_imports() -> dict[str, list[tuple[int, str]]]:
    root = Path(quasar.__file__).parent
    found = {str(p.relative_to(root.parent)): lazy_imports(p.read_text(encoding="utf-8"))
             for p in sorted(root.rglob("*.py"))}
    return {path: imports for path, imports in found.items() if imports}


def test_lazy_imports_are_found():
    source = ("import os\n"
              "def f():\n"
              "    import json  # lazy: a reason\n"
              "    def g():\n"
              "        from pathlib import (\n"
              "            Path)\n"
              "class C:\n"
              "    import re\n"
              "    async def h(self):\n"
              "        import sys\n")
    assert [n for n, _ in lazy_imports(source)] == [3, 5, 10]
    assert [bool(LAZY_REASON.search(line)) for _, line in lazy_imports(source)] == [True, False, False]


def test_few_imports_inside_functions():
    """Imports belong at the top of a module; one inside a function is kept only where it
    must be (an optional dependency, a module too slow to load for what imports it)."""
    found = _package_lazy_imports()
    total = sum(len(v) for v in found.values())
    per_file = ", ".join(f"{path} {len(v)}" for path, v in sorted(found.items(), key=lambda kv: -len(kv[1])))
    assert total <= MAX_LAZY_IMPORTS, f"{total} imports inside functions (at most {MAX_LAZY_IMPORTS}): {per_file}"


def test_every_import_inside_a_function_says_why():
    unexplained = [f"{path}:{n}: {line.strip()}" for path, imports in _package_lazy_imports().items()
                   for n, line in imports if not LAZY_REASON.search(line)]
    assert not unexplained, "imports inside functions without a `# lazy: reason` comment:\n" + "\n".join(unexplained)


# --------------------------------------------------------------------------- the command line


def _handlers(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each (sub)command's handler, "module:function", by command path ("cache verify")."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub.get_default("handler"):
                    found[name] = sub.get_default("handler")
                found.update({f"{name} {k}": v for k, v in _handlers(sub).items()})
    return found


def test_the_command_parser_loads_no_torch():
    """`quasar --help` and argument errors stay fast: the parser is argparse only."""
    code = ("import sys; from quasar.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'numpy', 'fastapi', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_command_has_a_handler_that_loads():
    from quasar.cli.main import build_parser, load_handler

    handlers = _handlers(build_parser())
    assert {"generate", "quantize", "export", "bench", "eval", "serve", "cache verify"} <= set(handlers)
    for command, spec in handlers.items():
        assert spec.startswith("quasar.cli."), command
        assert callable(load_handler(spec)), command
