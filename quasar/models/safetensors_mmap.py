"""Read a safetensors file as tensors that view one private memory map of it.

Nothing is copied at load time: a tensor's pages are read from disk (or the page cache,
which makes a second start fast) when they are first touched, and an int8 checkpoint costs
only the weights a step reads. The map is private (copy-on-write), so writing to a tensor
never changes the file. A tensor whose offset is not a multiple of its element size (the
format allows it; writers normally align) is copied out instead of viewed. A mapped file
must not be rewritten in place while in use (Quasar itself only replaces files by rename,
which leaves a mapped old version intact).

The file layout: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the data, offsets relative to its start.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import torch

from quasar.errors import QuasarError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER_BYTES = 100_000_000  # the format's own limit


def _corrupt(path: Path, why: str) -> QuasarError:
    return QuasarError(f"{path}: corrupt or truncated safetensors file ({why})")


def read_header(path: Path) -> tuple[dict, int]:
    """The tensor entries of ``path``'s header and the file offset where the data starts."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, "shorter than its 8-byte header length")
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER_BYTES:
                raise _corrupt(path, f"header length {n} is implausible")
            raw = f.read(n)
    except OSError as e:
        raise QuasarError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) < n:
        raise _corrupt(path, "header cut short")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _corrupt(path, f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


class Entry(NamedTuple):
    dtype: torch.dtype
    shape: list[int]
    begin: int  # byte offsets into the data
    end: int


def _entry(path: Path, name: str, info) -> Entry:
    try:
        dtype = DTYPES[info["dtype"]]
        shape = [int(d) for d in info["shape"]]
        begin, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise _corrupt(path, f"bad header entry for {name}: {info!r}") from None
    if any(d < 0 for d in shape) or end - begin != math.prod(shape) * dtype.itemsize:
        raise _corrupt(path, f"{name}: shape {shape} of {info['dtype']} does not fit offsets {begin}..{end}")
    return Entry(dtype, shape, begin, end)


def tensor_entries(path: str | Path) -> tuple[dict[str, Entry], int]:
    """The checked header of ``path``: its tensors' entries and the file offset of the data.

    Reads the header only, so checking a whole model directory this way is cheap.
    """
    path = Path(path)
    header, data_start = read_header(path)
    entries = {name: _entry(path, name, info) for name, info in header.items()}
    # Like the reference reader: the tensors must tile the data exactly, without gaps or
    # overlaps, so a truncated or padded-out file is caught here, not by a crash later.
    expected = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.begin != expected:
            raise _corrupt(path, f"{name} starts at {e.begin}, expected {expected}")
        expected = e.end
    size = path.stat().st_size
    if data_start + expected != size:
        raise _corrupt(path, f"{size} bytes, the header describes {data_start + expected}")
    return entries, data_start


def mmap_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, viewing one private map of the file."""
    path = Path(path)
    entries, data_start = tensor_entries(path)
    size = data_start + max((e.end for e in entries.values()), default=0)
    if size == data_start:  # nothing to map (mmap refuses empty ranges)
        return {name: torch.empty(e.shape, dtype=e.dtype) for name, e in entries.items()}
    try:
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    except RuntimeError as e:
        raise QuasarError(f"{path}: cannot memory-map ({e})") from None
    tensors = {}
    for name, e in entries.items():
        offset = data_start + e.begin
        if offset % e.dtype.itemsize == 0:
            tensors[name] = torch.empty(0, dtype=e.dtype).set_(storage, offset // e.dtype.itemsize, e.shape)
        else:
            raw = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (e.end - e.begin,))
            tensors[name] = raw.clone().view(e.dtype).reshape(e.shape)
    return tensors
