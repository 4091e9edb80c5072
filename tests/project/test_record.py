"""The benchmark record stays one a newcomer can read (#50): BENCHMARKS.md short, HISTORY.md
condensed, and docs/bench/ holding only the runs BENCHMARKS.md cites, each of which exists.

Runs dropped from docs/bench/ stay reachable in git history (HISTORY.md says how)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "BENCHMARKS.md"
BENCH_DIR = REPO / "docs" / "bench"
HISTORY = BENCH_DIR / "HISTORY.md"

MAX_BENCH_DIR_BYTES = 2 * 1024 * 1024
MAX_HISTORY_LINES = 400
MAX_BENCHMARKS_CHARS = 12_000
# A run folder is named DATE-TAG by `quasar bench --out docs/bench/DATE-TAG`.
RUN_NAME = re.compile(r"\b\d{4}-\d{2}-\d{2}-[A-Za-z0-9][A-Za-z0-9.-]*[A-Za-z0-9]")


def cited_runs() -> set[str]:
    return set(RUN_NAME.findall(BENCHMARKS.read_text(encoding="utf-8")))


def run_folders() -> set[str]:
    return {p.name for p in BENCH_DIR.iterdir() if p.is_dir()}


def test_bench_dir_is_at_most_2_mb():
    total = sum(p.stat().st_size for p in BENCH_DIR.rglob("*") if p.is_file())
    assert total <= MAX_BENCH_DIR_BYTES, (
        f"docs/bench/ holds {total / 2**20:.2f} MiB (limit {MAX_BENCH_DIR_BYTES / 2**20:g} MiB): "
        "keep only the runs "
        "BENCHMARKS.md cites, their report.md, results.json, serving.md and serving.json"
    )


def test_history_is_at_most_400_lines():
    lines = len(HISTORY.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_HISTORY_LINES, f"HISTORY.md has {lines} lines (limit {MAX_HISTORY_LINES})"


def test_benchmarks_is_at_most_12000_characters():
    chars = len(BENCHMARKS.read_text(encoding="utf-8"))
    assert chars <= MAX_BENCHMARKS_CHARS, (
        f"BENCHMARKS.md has {chars} characters (limit {MAX_BENCHMARKS_CHARS})"
    )


def test_every_run_cited_in_benchmarks_exists():
    cited = cited_runs()
    assert cited, "BENCHMARKS.md names no run folder; every figure should name its run"
    missing = sorted(cited - run_folders())
    assert not missing, f"BENCHMARKS.md cites run folders missing from docs/bench/: {missing}"


def test_bench_dir_holds_only_cited_runs():
    uncited = sorted(run_folders() - cited_runs())
    assert not uncited, (
        f"docs/bench/ holds runs BENCHMARKS.md does not cite: {uncited} "
        "(cite them, or delete them: git history keeps them)"
    )
