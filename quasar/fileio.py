"""Files: written so that a reader never sees them half-written; read with clear errors.

A file is written to a temporary sibling and renamed over the target; a folder is filled
as a temporary sibling and renamed into place. A crash or an error leaves the target as it
was (absent, or the previous version) and removes the temporary. A user's file that
cannot be read is a one-line QuasarError that names it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from quasar.errors import QuasarError


def _umask() -> int:
    # The only portable way to read the umask is to set it. Set the most private one meanwhile:
    # a file another thread creates in that instant comes out private, never more open.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` via a temporary file in the same folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a plain open() would not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_dir(out: str | Path, fill: Callable[[Path], None], exist_ok: bool = False) -> Path:
    """Run ``fill(tmp)`` on a temporary sibling folder of ``out``, then rename it to ``out``.

    With ``exist_ok`` an ``out`` that appears meanwhile (another process built the same
    cache entry) is kept and the temporary dropped; without it, an existing ``out`` is an
    error before and after filling.
    """
    out = Path(out)
    if out.exists() and not exist_ok:
        raise QuasarError(f"{out} already exists; choose a new output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fill(tmp)
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; a plain mkdir would not
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.exists():
                raise
            if not exist_ok:
                raise QuasarError(f"{out} already exists; choose a new output directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
