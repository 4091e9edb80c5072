"""scripts/tools/bench_kernels.py: on one small shape it times every exact int8 CPU path and the
real Int8Linear, and prints one table row per (shape, M)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "bench_kernels.py"
_spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bk)


def test_prints_a_row_per_shape_and_m(monkeypatch, capsys):
    monkeypatch.setattr(bk, "SHAPES", [("tiny 48x32", 48, 32)])
    bk.main(["--threads", "1", "--rounds", "1", "--budget-ms", "0.05", "--m", "1", "2"])
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split(" | ")
    assert header[:3] == ["shape", "M", "fp32"] and header[-2:] == ["Int8Linear", "fp32/Int8Linear"]
    from quasar.runtime.w8a8_backends import exact_cpu_variants

    # a column pair per exact oneDNN variant: none where oneDNN is not exact (CPUs without VNNI)
    for name in exact_cpu_variants():
        assert f"gemm {name}" in header and f"layer {name}" in header
    rows = [line.split(" | ") for line in lines[3:]]
    assert [r[:2] for r in rows] == [["tiny 48x32", "1"], ["tiny 48x32", "2"]]
    assert all(len(r) == len(header) and r[-1].endswith("x") for r in rows)
