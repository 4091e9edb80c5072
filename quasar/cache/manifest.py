"""Manifests: the size and content hash of every file of a directory Quasar wrote.

``fileio.atomic_dir`` writes MANIFEST into a cache entry or checkpoint last, just before the
directory is renamed into place; loading checks the files against it, so a flipped byte
anywhere (a weight, the tokenizer, the config, the manifest itself) is found before it can
change a token. The hash is XXH3-128: a check at memory speed against damage (disk, copy,
a stray write), not against someone who can rewrite the manifest too. A file is read in
CHUNK-sized reads into one buffer, so a check holds CHUNK bytes, never the file; its pages
stay in the page cache, where the loader's memory map finds them next.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from quasar.errors import QuasarError

MANIFEST = "quasar-manifest.json"
FORMAT = "quasar-manifest"
VERSION = 1
ALGORITHM = "xxh3_128"
CHUNK = 4 << 20
WORKERS = 4  # files hashed at once: reads from the page cache scale with cores up to memory bandwidth

# (device, inode) -> (size, mtime, ctime, hash) of files this process found whole, so the loader
# and the quantizer's source reading one directory check it once; any write changes the ctime.
_verified: dict[tuple[int, int], tuple] = {}


def hash_file(path: str | Path) -> str:
    """XXH3-128 of a file's bytes, read CHUNK bytes at a time."""
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.relative_to(folder).as_posix() != MANIFEST)


def _check(body: dict) -> str:
    """The manifest's hash of itself: a flipped byte in it is found like one in any other file."""
    return xxhash.xxh3_128(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(folder: str | Path) -> dict:
    """Hash every file under ``folder`` and write MANIFEST there; returns its contents."""
    folder = Path(folder)
    with ThreadPoolExecutor(WORKERS) as pool:
        names = _listing(folder)
        digests = list(pool.map(lambda rel: hash_file(folder / rel), names))
    files = {rel: {"size": (folder / rel).stat().st_size, ALGORITHM: d} for rel, d in zip(names, digests)}
    body = {"format": FORMAT, "version": VERSION, "hash": ALGORITHM, "files": files}
    doc = {**body, "check": _check(body)}
    (folder / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def _damaged_manifest(path: Path, why: str) -> QuasarError:
    return QuasarError(f"{path}: damaged manifest ({why})")


def _entry_ok(rel, entry) -> bool:
    return (isinstance(rel, str) and rel and not rel.startswith("/") and ".." not in rel.split("/")
            and isinstance(entry, dict) and isinstance(entry.get("size"), int)
            and isinstance(entry.get(ALGORITHM), str))


def read_manifest(folder: str | Path) -> dict | None:
    """The manifest of ``folder`` (None when it has none), its own check passed."""
    path = Path(folder) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _damaged_manifest(path, "not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _damaged_manifest(path, f"not a {FORMAT}")
    if doc.get("version") != VERSION or doc.get("hash") != ALGORITHM:
        raise QuasarError(f"{path}: manifest version {doc.get('version')!r} with hash {doc.get('hash')!r} is not "
                          f"supported (this Quasar writes version {VERSION}, {ALGORITHM})")
    check = doc.pop("check", None)
    if check != _check(doc):
        raise _damaged_manifest(path, "its own check does not match")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(_entry_ok(rel, e) for rel, e in files.items()):
        raise _damaged_manifest(path, "bad file list")
    return doc


def _verify_file(path: Path, entry: dict) -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise QuasarError(f"{path}: missing (listed in its directory's {MANIFEST})") from None
    if st.st_size != entry["size"]:
        raise QuasarError(f"{path}: damaged ({st.st_size} bytes, its {MANIFEST} says {entry['size']})")
    key, seen = (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns, entry[ALGORITHM])
    if _verified.get(key) == seen:
        return
    if hash_file(path) != entry[ALGORITHM]:
        raise QuasarError(f"{path}: damaged (its content does not match its {MANIFEST})")
    _verified[key] = seen


def verify(folder: str | Path, *, required: bool, select: Callable[[str], bool] | None = None) -> int | None:
    """Check the files of ``folder`` (those ``select`` accepts: all by default) against its
    manifest; returns the bytes checked, or None when it has no manifest and none is
    ``required``. A missing, resized or changed file is a one-line QuasarError naming it."""
    folder = Path(folder)
    doc = read_manifest(folder)
    if doc is None:
        if required:
            raise QuasarError(f"{folder}: no {MANIFEST} (written by an older Quasar, or not completely)")
        return None
    items = [(folder / rel, e) for rel, e in doc["files"].items() if select is None or select(rel)]
    with ThreadPoolExecutor(WORKERS) as pool:
        for done in [pool.submit(_verify_file, path, e) for path, e in items]:
            done.result()  # the first failure in listing order
    return sum(e["size"] for _, e in items)
