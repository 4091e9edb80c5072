"""`quasar cache verify`: check cache entries and checkpoints against their manifests.

    quasar cache verify [PATH ...] [--delete]

Without PATH, every entry under ``$QUASAR_CACHE`` (GGUF conversions, W8A8 and W4A8
verifiers). One line per entry: ``ok``, ``unchecked`` (a directory outside the cache with no
manifest: an older checkpoint or another tool's export) or ``DAMAGED`` with the first bad
file; exit status 1 when any is damaged. Light to import (no torch): it runs in place.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from quasar.cache.entries import all_entries, discard
from quasar.cache.manifest import read_manifest, verify
from quasar.errors import QuasarError
from quasar.paths import cache_root, in_cache


def register(sub) -> None:
    p = sub.add_parser("cache", help="check the Quasar cache",
                       description="Inspect what Quasar keeps under $QUASAR_CACHE (default ~/.cache/quasar).")
    actions = p.add_subparsers(dest="cache_command", required=True)
    v = actions.add_parser(
        "verify", help="check cache entries and checkpoints against their manifests",
        description="Read every file of each entry (or checkpoint directory) and compare its size and hash "
                    "with the entry's manifest. Loading does the same before using an entry; this does it "
                    "on demand. Exit status 1 when any is damaged.")
    v.add_argument("paths", nargs="*", metavar="PATH",
                   help="cache entries or checkpoint directories (default: every entry under $QUASAR_CACHE)")
    v.add_argument("--delete", action="store_true",
                   help="remove damaged cache entries (each is rebuilt when next needed)")
    v.set_defaults(handler="quasar.cli.cache:run_verify")


def _verify_one(path, delete: bool) -> bool:
    """Check one directory and print its line; False when it is damaged."""
    path = Path(path)
    if not path.is_dir():
        print(f"DAMAGED    {path}: not a directory")
        return False
    cached, t0 = in_cache(path), time.perf_counter()
    try:
        checked = verify(path, required=cached)
    except QuasarError as e:
        removed = ""
        if delete and cached:
            discard(path, path.stat().st_ino)
            removed = " (removed)"
        print(f"DAMAGED    {path}: {e}{removed}")
        return False
    if checked is None:
        print(f"unchecked  {path}: no manifest (an older checkpoint, or another tool's)")
        return True
    files = len(read_manifest(path)["files"])
    print(f"ok         {path} ({files} files, {checked / 1e6:.0f} MB, {time.perf_counter() - t0:.2f} s)")
    return True


def run_verify(args) -> int:
    paths = args.paths or all_entries()
    if not paths:
        print(f"no cache entries under {cache_root()}", file=sys.stderr)
        return 0
    results = [_verify_one(p, args.delete) for p in paths]  # every one, not just up to the first bad
    return 0 if all(results) else 1
