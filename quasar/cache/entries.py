"""Looking a cache entry up: loaded when whole, else dropped (one line on stderr) for a rebuild.

Entries are written once (``fileio.atomic_dir``) and never changed in place, so loading one
needs no lock; only removing a damaged one does, so that a process cannot remove the entry
another has just rebuilt.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from quasar.cache.locking import entry_lock
from quasar.cache.temps import remove_stale_temps, temp_path
from quasar.errors import QuasarError
from quasar.paths import ENTRY_KINDS, cache_dir

T = TypeVar("T")


def lookup(target: str | Path, load: Callable[[Path], T], what: str) -> T | None:
    """``load(target)`` when the entry is there and whole (``load`` checks it: a QuasarError
    says it is not); None when it is absent, or damaged: then it is reported on stderr in one
    line and removed, to be rebuilt. Temporaries of dead builds in its folder are removed."""
    target = Path(target)
    remove_stale_temps(target.parent)
    try:
        inode = target.stat().st_ino
    except FileNotFoundError:
        return None
    try:
        return load(target)
    except QuasarError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"warning: rebuilding the {what} cache entry {target}: {why}", file=sys.stderr, flush=True)
        discard(target, inode)
        return None


def discard(target: str | Path, inode: int) -> None:
    """Remove the entry ``target`` if it is still the folder ``inode`` (not one another process
    rebuilt meanwhile). A cache that cannot be changed (read-only) is left as it is."""
    target = Path(target)
    try:
        with entry_lock(target):
            if target.stat().st_ino != inode:
                return
            aside = temp_path(target)
            os.rename(target, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def all_entries() -> list[Path]:
    """Every entry under ``$QUASAR_CACHE`` that carries a manifest (paths.ENTRY_KINDS), sorted."""
    found = []
    for kind in ENTRY_KINDS:
        folder = cache_dir(kind)
        if folder.is_dir():
            found += sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    return found


def entry_path(folder: str | Path, label: str, digest: str) -> Path:
    """The entry keyed ``digest`` in ``folder``: ``LABEL-DIGEST``, the label only for people
    reading the folder; an entry of that digest under another label (a renamed model) is it."""
    folder = Path(folder)
    found = sorted(folder.glob(f"*-{digest}")) if folder.is_dir() else []
    found = [p for p in found if not p.name.startswith(".")]
    return found[0] if found else folder / f"{label}-{digest}"
