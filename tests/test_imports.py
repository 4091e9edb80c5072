"""Every module imports alone (no import cycles), and dependencies point one way.

Each module is imported in a fresh interpreter, so a cycle cannot hide behind an import
order that happens to work. The lower layers must not pull in the upper ones: `models` and
`data` never load `quant`, `speculative`, `api` or the front ends.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import quasar

# (`quasar.__main__` runs the CLI when imported; it is `python -m quasar`, not a module to import)
MODULES = sorted(m.name for m in pkgutil.walk_packages(quasar.__path__, "quasar.") if m.name != "quasar.__main__")
# layer -> packages it must never load
FORBIDDEN = {
    "quasar.models": ("quasar.quant", "quasar.speculative", "quasar.api", "quasar.bench", "quasar.eval",
                      "quasar.server", "quasar.cli"),
    "quasar.data": ("quasar.models", "quasar.quant", "quasar.speculative", "quasar.api", "quasar.bench",
                    "quasar.eval", "quasar.server", "quasar.cli"),
    "quasar.quant": ("quasar.speculative", "quasar.api", "quasar.bench", "quasar.eval", "quasar.server",
                     "quasar.cli"),
    "quasar.speculative": ("quasar.quant", "quasar.api", "quasar.bench", "quasar.eval", "quasar.server",
                           "quasar.cli"),
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
    assert {"quasar.models.llama", "quasar.quant.int8", "quasar.speculative.generate", "quasar.api",
            "quasar.cli"} <= set(MODULES)


def test_every_module_imports_alone(imported):
    assert set(imported) == set(MODULES)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(imported, layer):
    for name, loaded in imported.items():
        if name == layer or name.startswith(layer + "."):
            bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN[layer])]
            assert not bad, f"{name} loads {bad}"
