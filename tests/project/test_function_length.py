"""No function in quasar/ runs over MAX_LINES lines, Python or C++: a function a reader
cannot see whole is one to split by concern.

A Python function's length runs from its `def` line to its last line, docstring and comments
included; a nested function counts within its parent as well as on its own. A C++ function's
(quasar/kernels/csrc) is lizard's `length`, the same notion: from the first line of its
signature to its closing brace, comments and blank lines included (not its NLOC, which
leaves them out); a lambda counts within its function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import quasar

import lizard  # pinned in requirements-test.txt / constraints.txt: scripts/setup/setup.sh installs it

MAX_LINES = 80
ROOT = Path(quasar.__file__).parent
CSRC = ROOT / "kernels" / "csrc"
CPP_SUFFIXES = (".cpp", ".h", ".inc")
# Python functions allowed over the limit, "path relative to quasar/::qualified name" -> why
# (empty: none may).
ALLOWED: dict[str, str] = {}


def function_lengths(path: Path) -> dict[str, int]:
    """Qualified name (Class.method, outer.inner) -> lines, for every function in `path`."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return lengths


def long_functions() -> dict[str, int]:
    return {f"{path.relative_to(ROOT).as_posix()}::{name}": n
            for path in sorted(ROOT.rglob("*.py"))
            for name, n in function_lengths(path).items() if n > MAX_LINES}


def test_lengths_are_counted_from_def_to_last_line(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class C:\n    @staticmethod\n    def f():\n        def g():\n            pass\n\n        return g\n")
    assert function_lengths(src) == {"C.f": 5, "C.f.g": 2}


def test_no_function_over_the_limit():
    too_long = {name: n for name, n in long_functions().items() if name not in ALLOWED}
    assert not too_long, f"functions over {MAX_LINES} lines: {too_long}"


def test_the_allowed_list_holds_only_long_functions():
    # an entry whose function was split (or renamed) must go, so the list only shrinks
    stale = set(ALLOWED) - set(long_functions())
    assert not stale, f"no longer over {MAX_LINES} lines (drop them from ALLOWED): {sorted(stale)}"


def cpp_function_lengths(path: Path) -> dict[str, int]:
    """Function name (with its first line, as overloads and templates repeat names) -> lines,
    for every C++ function in `path`, by lizard."""
    info = lizard.analyze_file.analyze_source_code(path.name, path.read_text(encoding="utf-8"))
    return {f"{fn.name}@{fn.start_line}": fn.length for fn in info.function_list}


def long_cpp_functions() -> dict[str, int]:
    return {f"{path.relative_to(CSRC).as_posix()}::{name}": n
            for path in sorted(p for p in CSRC.rglob("*") if p.suffix in CPP_SUFFIXES)
            for name, n in cpp_function_lengths(path).items() if n > MAX_LINES}


def test_cpp_lengths_are_counted_from_signature_to_closing_brace(tmp_path):
    src = tmp_path / "m.cpp"
    src.write_text("// f\nint f(int a,\n      int b) {\n  // a comment\n\n  return a + b;\n}\n")
    assert cpp_function_lengths(src) == {"f@2": 6}


def test_no_cpp_function_over_the_limit():
    assert any(CSRC.rglob("*.cpp")), f"no C++ sources under {CSRC}"
    too_long = long_cpp_functions()
    assert not too_long, f"C++ functions over {MAX_LINES} lines: {too_long}"
