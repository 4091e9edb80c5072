"""Temporaries a later run can find: ``.NAME.tmp-<pid>-<random>``, locked while their owner lives.

An atomic write fills a temporary sibling of its target and renames it into place. A process
killed meanwhile (SIGKILL, a power cut, SIGTERM with no handler) leaves the temporary behind.
Its owner held an ``flock`` on it for as long as it lived, and the kernel dropped that lock
with the process, so the next run that writes into the folder (or looks a cache entry up
there) removes the unlocked ones. The pid in the name says whose it was; the lock, not the
pid, says whether the owner lives, which stays right when pids are reused or a cache folder
is shared between containers.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quasar.cache.locking import try_lock

TEMP_NAME = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}")
# A temporary is locked right after it is created; one younger than this whose pid runs may be
# in that instant, so it is left alone.
YOUNG_S = 60.0


def temp_path(target: str | Path) -> Path:
    target = Path(target)
    return target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


@contextmanager
def temp_dir(target: str | Path) -> Iterator[Path]:
    """A new private folder beside ``target``, locked by this process; removed on exit
    unless it was renamed away meanwhile."""
    tmp = temp_path(target)
    tmp.mkdir(mode=0o700)
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


@contextmanager
def temp_file(target: str | Path) -> Iterator[tuple[int, Path]]:
    """(fd open for writing, path) of a new private file beside ``target``, locked by this
    process; removed on exit unless it was renamed away meanwhile."""
    tmp = temp_path(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd, tmp
    finally:
        tmp.unlink(missing_ok=True)
        os.close(fd)


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(path: Path, pid: int) -> int | None:
    """A lock on ``path`` when its owner is gone, else None."""
    try:
        young = time.time() - path.lstat().st_mtime < YOUNG_S
    except FileNotFoundError:
        return None
    if young and _pid_runs(pid):
        return None
    return try_lock(path)


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Remove the temporaries in ``folder`` whose owner is gone; returns what was removed."""
    folder = Path(folder)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        m = TEMP_NAME.fullmatch(name)
        if m is None:
            continue
        path = folder / name
        fd = _stale(path, int(m["pid"]))
        if fd is None:
            continue
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
