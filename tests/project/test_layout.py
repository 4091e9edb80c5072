"""No package of `quasar/` grows past a share of the whole: each does one job (models, kernels,
runtime, quantization, drafting, the engine, the front ends), and one holding much more than
its share is doing several."""

from __future__ import annotations

from pathlib import Path

import quasar

ROOT = Path(quasar.__file__).parent
MAX_SHARE = 0.30
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".inc", ".html")


def lines(folder: Path) -> int:
    return sum(len(p.read_text(encoding="utf-8").splitlines()) for p in folder.rglob("*")
               if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts)


def test_no_package_holds_more_than_its_share():
    total = lines(ROOT)
    shares = {p.name: lines(p) / total for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"kernels", "runtime", "quant", "engine", "cli"} <= set(shares)
    largest = max(shares, key=shares.get)
    assert shares[largest] <= MAX_SHARE, f"quasar/{largest}/ holds {shares[largest]:.0%} of quasar/'s lines"
