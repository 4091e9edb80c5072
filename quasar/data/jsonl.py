"""Reading JSONL files: one object per line, errors naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from quasar.errors import QuasarError
from quasar.fileio import reading


def iter_jsonl(path: Path, opener: Any = open) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) per non-blank line; errors name file and line."""
    with reading(path), opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise QuasarError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise QuasarError(f"{path}:{lineno}: expected a JSON object per line")
            yield lineno, obj


def take(records: Iterator[Any], limit: int | None) -> list[Any]:
    """First ``limit`` records (all when None) in file order, so runs are repeatable."""
    if limit is not None and limit < 0:
        raise QuasarError(f"limit must be >= 0, got {limit}")
    out: list[Any] = []
    for rec in records:
        if limit is not None and len(out) >= limit:
            break
        out.append(rec)
    return out
