"""One build of a cache entry at a time: an exclusive ``flock`` on a sibling lock file.

``entry_lock(target)`` locks ``.NAME.lock`` beside ``target``: a second process that needs the
same entry waits there, then finds the entry built and loads it. The kernel drops the lock
when its holder dies (SIGKILL included), so a crashed build never blocks the next. The lock
file is removed on release; a waiter checks that the file it locked is still the one at the
path (else it locks the new one), so removing it cannot let two builders in.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def lock_path(target: str | Path) -> Path:
    target = Path(target)
    return target.parent / f".{target.name}.lock"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _acquire(path: Path, wait_message: str | None) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if wait_message:
                    print(wait_message, file=sys.stderr, flush=True)
                    wait_message = None
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the holder removed it meanwhile: lock the file now at the path


@contextmanager
def entry_lock(target: str | Path, waiting: str | None = None) -> Iterator[None]:
    """Hold the build lock of ``target``; ``waiting`` is printed (one line, stderr) if
    another process holds it. OSError when the folder cannot hold a lock file (read-only)."""
    path = lock_path(target)
    fd = _acquire(path, waiting)
    try:
        yield
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.close(fd)


def try_lock(path: str | Path) -> int | None:
    """An fd holding an exclusive lock on ``path`` (a file or a folder), or None when someone
    else holds it (or it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
