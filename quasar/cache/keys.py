"""Cache keys from what a source holds, not where it is or when it was touched.

A file's key is its size and a hash of SAMPLES blocks of BLOCK bytes spread evenly from its
first byte to its last (the whole file when it is smaller than that): a few MB read even for
a model of many GB, and it changes with anything that rewrites a model (new weights differ
everywhere). Paths and modification times are left out, so a cache copied elsewhere (or a
model file moved or copied with new times) finds its entries again.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

BLOCK = 64 << 10
SAMPLES = 16


def sampled_digest(path: str | Path) -> str:
    """XXH3-128 of the file's size and of SAMPLES evenly spaced blocks of it."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        size = f.seek(0, 2)
        h.update(size.to_bytes(8, "little"))
        if size <= SAMPLES * BLOCK:
            f.seek(0)
            h.update(f.read())
            return h.hexdigest()
        last = size - BLOCK
        for i in range(SAMPLES):
            f.seek(last * i // (SAMPLES - 1))
            h.update(f.read(BLOCK))
    return h.hexdigest()


def file_key(path: str | Path) -> list:
    """[size, sampled digest] of one file."""
    path = Path(path)
    return [path.stat().st_size, sampled_digest(path)]


def dir_key(folder: str | Path, names: list[str]) -> list:
    """[[name, size, sampled digest], ...] of the files ``names`` of ``folder`` (names
    relative to it: what the folder holds, never where it is)."""
    folder = Path(folder)
    return [[name, *file_key(folder / name)] for name in sorted(names)]
