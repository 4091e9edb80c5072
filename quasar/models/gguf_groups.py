"""GGUF's 4-bit weights as affine int4 groups of 32, exactly as the file stores them.

A model that arrives as a Q4_0, Q4_1 or Q4_K GGUF is, dequantized, the float model Quasar
decodes and measures against. Those blocks are already affine int4 per 32 weights
(w = scale * q + offset, q in [0, 15]); a W4A8 verifier (issue #34) that takes them over as
they are keeps the file's own weights, where rounding the dequantized floats again loses a
second time. ``int4_groups`` reads them; ``dequantize_groups`` is the float model's weight,
bit for bit what the `gguf` package's dequantizer gives (every product below is exact in
float32, and the one rounding, the offset's add, happens in the same order).

Q6_K and 8-bit tensors (a Q4_K_M file keeps some attention values, down projections and
the output in Q6_K) have no 4-bit form: ``int4_groups`` returns None for them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QuantType
from gguf import GGUFReader
from gguf.quants import Q4_K

from quasar.errors import QuasarError

GROUP = 32  # weights per group in every 4-bit GGUF type read here


def is_int4_type(tensor_type) -> bool:
    """Whether ``int4_groups`` reads tensors of this GGUF type (Q4_0, Q4_1, Q4_K)."""
    return tensor_type in (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q4_K)


def stores_int4(path: Path) -> bool:
    """Whether the GGUF file at `path` stores a tensor ``int4_groups`` reads. Parsing a large
    file's header takes seconds, so once a process per file version (path, size, mtime)."""
    st = path.stat()
    return _stores_int4(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _stores_int4(path: str, size: int, mtime_ns: int) -> bool:
    return any(is_int4_type(t.tensor_type) for t in GGUFReader(path).tensors)


def int4_groups(data: np.ndarray, tensor_type, shape: tuple[int, int]):
    """(q uint8 [rows, cols] in [0, 15], scale, offset float32 [rows, cols / 32]) of a 4-bit
    GGUF matrix given as the reader gives it (``t.data``, ``t.tensor_type``, HF shape
    [rows, cols]); None for a type with no 4-bit form. Rows are in the file's order:
    llama.cpp permutes a llama model's Q and K rows, and ``gguf._unpermute`` undoes that on
    q, scale and offset alike."""
    rows, cols = shape
    if cols % GROUP:
        raise QuasarError(f"a 4-bit GGUF row of {cols} weights is not whole groups of {GROUP}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1)
    if tensor_type == QuantType.Q4_0:  # 18 bytes: d, 16 bytes of nibbles; w = d * (q - 8)
        b = blocks.reshape(rows, cols // 32, 18)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        return _nibbles(b[..., 2:], rows, cols, span=32), d, -8 * d
    if tensor_type == QuantType.Q4_1:  # 20 bytes: d, m, 16 bytes of nibbles; w = d * q + m
        b = blocks.reshape(rows, cols // 32, 20)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        m = b[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
        return _nibbles(b[..., 4:], rows, cols, span=32), d, m
    if tensor_type == QuantType.Q4_K:  # 144 bytes a 256: d, dmin, 12 bytes of 6-bit scales and mins, nibbles
        b = blocks.reshape(rows * cols // 256, 144)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        scale = (d * sc.astype(np.float32)).reshape(rows, cols // 32)
        offset = -(dmin * mn.astype(np.float32)).reshape(rows, cols // 32)
        return _nibbles(b[:, 16:].reshape(rows, -1, 32), rows, cols, span=64), scale, offset
    return None


def q4k_codes(data: np.ndarray, shape: tuple[int, int]):
    """A Q4_K matrix's two-level parameters as they are stored, for the W4A8 Q4_K form:
    (scale codes c, offset codes o uint8 [rows, cols / 32]; d, m float16 [rows, cols / 256])
    with ``int4_groups``' scale = d * c and offset = m * o exactly (m is the file's -dmin: a
    float16 negation is exact)."""
    rows, cols = shape
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows * cols // 256, 144)
    d = b[:, 0:2].copy().view(np.float16).reshape(rows, cols // 256)
    m = -b[:, 2:4].copy().view(np.float16).reshape(rows, cols // 256)
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])
    return (sc.astype(np.uint8).reshape(rows, cols // 32), mn.astype(np.uint8).reshape(rows, cols // 32), d, m)


def q6k_blocks(data: np.ndarray, shape: tuple[int, int]):
    """A Q6_K matrix as stored, for the W4A8 Q6_K form: (q uint8 [rows, cols] in [0, 63], int8
    scales [rows, cols / 16], float16 d [rows, cols / 256]); w = d * s * (q - 32), what the
    `gguf` package's dequantizer computes. A block of 256: 128 bytes of low nibbles (two 64-byte
    halves, each 64 weights low then 64 high), 64 bytes of high bit pairs (two 32-byte halves,
    each 4 x 32 weights at shifts 0, 2, 4, 6), 16 scales, d."""
    rows, cols = shape
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows * cols // 256, 210)
    low = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(-1, 256) | high.reshape(-1, 256) << 4).reshape(rows, cols)
    scales = b[:, 192:208].copy().view(np.int8).reshape(rows, cols // 16)
    d = b[:, 208:210].copy().view(np.float16).reshape(rows, cols // 256)
    return q, scales, d


def _nibbles(qs: np.ndarray, rows: int, cols: int, span: int) -> np.ndarray:
    """Unpack nibble bytes [rows, chunks, span / 2]: within each chunk of `span` weights the
    low nibbles are the first half, the high nibbles the second (Q4_0/Q4_1: a 32-weight
    block; Q4_K: a 64-weight pair of groups)."""
    qs = qs.reshape(rows, cols // span, span // 2)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(rows, cols)


def dequantize_groups(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> torch.Tensor:
    """float32 [rows, cols]: scale * q + offset per group, as the GGUF dequantizers compute it."""
    rows, cols = q.shape
    w = q.reshape(rows, cols // GROUP, GROUP).astype(np.float32) * scale[..., None] + offset[..., None]
    return torch.from_numpy(w.reshape(rows, cols))
