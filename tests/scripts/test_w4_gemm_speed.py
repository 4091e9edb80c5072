"""scripts/tools/w4_gemm_speed.py: on one tiny shape it times the W4A8 op against Int8Linear and
prints a row per row count."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "w4_gemm_speed.py"
_spec = importlib.util.spec_from_file_location("w4_gemm_speed", SCRIPT)
ws = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ws)


def test_prints_a_row_per_shape_and_m(monkeypatch, capsys):
    from quasar.kernels import ext

    if ext.w4a8_linear_op() is None:
        pytest.skip("no W4A8 C++ op")
    monkeypatch.setattr(ws, "SHAPES", [("tiny 40x64", 40, 64)])
    ws.main(["--threads", "1", "--rounds", "1", "--budget-ms", "0.05", "--rows", "1,4"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU ") and f"W4A8 {ext.w4a8_kernel_path()}" in lines[0]
    rows = [line.split(" | ") for line in lines[2:]]
    assert [r[:2] for r in rows] == [["tiny 40x64", "1"], ["tiny 40x64", "4"]]
    assert all(len(r) == 7 and r[-1].endswith("x") for r in rows)
