"""Files: written so that a reader never sees them half-written; read with clear errors.

A file is written to a temporary sibling and renamed over the target; a folder is filled
as a temporary sibling, given its manifest (quasar.cache.manifest) and renamed into place.
A crash or an error leaves the target as it was (absent, or the previous version); the
temporary is removed, or, when the process was killed, by the next run that writes into the
folder (quasar.cache.temps). Builds of a cache entry (``exist_ok``) take its lock
(quasar.cache.locking), so one process builds and the others wait and use the result. A
full disk is a one-line ``NoSpaceError`` that names the target and the space it needs. A
user's file that cannot be read is a one-line QuasarError that names it.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

from quasar.cache.locking import entry_lock
from quasar.cache.manifest import write_manifest
from quasar.cache.temps import remove_stale_temps, temp_dir, temp_file
from quasar.errors import QuasarError


class NoSpaceError(QuasarError, OSError):
    """The disk (or the quota) is full, or would be: a QuasarError for the command line, and an
    OSError for callers that go on without the cache when it cannot be written."""


def _umask() -> int:
    # The only portable way to read the umask is to set it. Set the most private one meanwhile:
    # a file another thread creates in that instant comes out private, never more open.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e7 else f"{n / 1e6:.0f} MB"


def _disk_full(e: BaseException) -> bool:
    # safetensors and tokenizers report the OS error inside their own exception types
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(s in str(e) for s in ("No space left on device", "os error 28", "Disk quota exceeded"))


def _free(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def _no_space(target: Path, need_bytes: int | None, freed: int = 0) -> NoSpaceError:
    """``freed``: bytes of the temporary about to be removed, free again for the next try."""
    free = _mb(_free(target.parent) + freed)
    need = f"about {_mb(need_bytes)}, {free} free" if need_bytes else f"more than the {free} free"
    return NoSpaceError(f"no space left on the device for {target}: it needs {need}")


def check_free_space(target: str | Path, need_bytes: int) -> None:
    """A NoSpaceError now, before any work, when ``target``'s folder has less than ``need_bytes`` free."""
    target = Path(target)
    if need_bytes > _free(target.parent):
        raise _no_space(target, need_bytes)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` via a temporary file in the same folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with temp_file(path) as (fd, tmp):
        try:
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if _disk_full(e):
                raise _no_space(path, len(raw)) from None
            raise
        os.chmod(tmp, 0o666 & ~_umask())  # private while written; a plain open() would not be
        os.replace(tmp, path)
    return path


def _rename(tmp: Path, out: Path, exist_ok: bool) -> None:
    try:
        os.rename(tmp, out)
    except OSError:
        if not out.exists():
            raise
        if not exist_ok:
            raise QuasarError(f"{out} already exists; choose a new output directory") from None


def atomic_dir(out: str | Path, fill: Callable[[Path], None], exist_ok: bool = False, *,
               need_bytes: int | None = None, manifest: bool = True) -> Path:
    """Run ``fill(tmp)`` on a temporary sibling folder of ``out``, write its manifest, then
    rename it to ``out``.

    With ``exist_ok`` (a cache entry) the build holds the entry's lock, and an ``out`` that
    exists once the lock is held (another process built it meanwhile) is kept unfilled;
    without it, an existing ``out`` is an error before and after filling. ``need_bytes``
    (an estimate of the result's size) is checked against the free space first.
    """
    out = Path(out)
    if out.exists() and not exist_ok:
        raise QuasarError(f"{out} already exists; choose a new output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out.parent)
    waiting = f"waiting for another process to finish writing {out}..."
    with entry_lock(out, waiting) if exist_ok else nullcontext():
        if exist_ok and out.exists():
            return out
        if need_bytes:
            check_free_space(out, need_bytes)
        with temp_dir(out) as tmp:
            try:
                fill(tmp)
                if manifest:
                    write_manifest(tmp)
            except Exception as e:
                if _disk_full(e):
                    raise _no_space(out, need_bytes, _size(tmp)) from None
                raise
            tmp.chmod(0o777 & ~_umask())  # private while filled; a plain mkdir would not be
            _rename(tmp, out, exist_ok)
    return out


@contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Turn the ways a user's text file fails to read into one-line QuasarErrors."""
    try:
        yield
    except FileNotFoundError:
        raise QuasarError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise QuasarError(f"{path}: is a directory, expected a file") from None
    except UnicodeDecodeError as e:
        raise QuasarError(f"{path}: not UTF-8 text ({e.reason})") from None


def read_text(path: str | Path) -> str:
    """A user's UTF-8 text file; QuasarErrors name what is wrong with it."""
    with reading(path):
        return Path(path).read_text(encoding="utf-8")
