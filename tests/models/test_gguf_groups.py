"""GGUF 4-bit blocks read as affine int4 groups (quasar.models.gguf_groups): the file's own
weights, bit for bit what the gguf package dequantizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, dequantize

from quasar.models.gguf_groups import GROUP, dequantize_groups, int4_groups
from quasar.data.packages import default_model_path


def _check(data: np.ndarray, qtype, rows: int, cols: int) -> None:
    got = int4_groups(data, qtype, (rows, cols))
    assert got is not None
    q, scale, offset = got
    assert q.dtype == np.uint8 and q.shape == (rows, cols) and int(q.max()) <= 15
    assert scale.shape == offset.shape == (rows, cols // GROUP)
    want = torch.from_numpy(dequantize(data, qtype).reshape(rows, cols).astype(np.float32))
    assert torch.equal(dequantize_groups(q, scale, offset), want)


def test_the_default_models_q4_1_tensors_come_back_bitwise() -> None:
    reader = GGUFReader(default_model_path())
    tensors = [t for t in reader.tensors if t.tensor_type == T.Q4_1]
    assert len(tensors) > 100
    for t in tensors[:12]:
        rows, cols = (int(d) for d in reversed(t.shape))
        _check(t.data, t.tensor_type, rows, cols)
    other = next(t for t in reader.tensors if t.tensor_type == T.Q8_0)
    assert int4_groups(other.data, other.tensor_type, tuple(int(d) for d in reversed(other.shape))) is None


def _random_blocks(gen: np.random.Generator, n_blocks: int, block_bytes: int, halves: int) -> np.ndarray:
    """Random block bytes with sane fp16 values in the first `halves` half-precision slots."""
    b = gen.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    h = gen.uniform(-0.05, 0.05, size=(n_blocks, halves)).astype(np.float16)
    b[:, : 2 * halves] = h.view(np.uint8).reshape(n_blocks, 2 * halves)
    return b


@pytest.mark.parametrize("qtype, block_bytes, block_weights, halves",
                         [(T.Q4_0, 18, 32, 1), (T.Q4_1, 20, 32, 2), (T.Q4_K, 144, 256, 2)])
def test_every_4bit_block_type_comes_back_bitwise(qtype, block_bytes: int, block_weights: int, halves: int) -> None:
    gen = np.random.default_rng(block_bytes)
    rows, cols = 6, 512
    data = _random_blocks(gen, rows * cols // block_weights, block_bytes, halves).reshape(rows, -1)
    _check(data, qtype, rows, cols)


def test_rows_that_are_not_whole_groups_are_refused() -> None:
    from quasar.errors import QuasarError

    with pytest.raises(QuasarError, match="whole groups"):
        int4_groups(np.zeros((1, 18), dtype=np.uint8), T.Q4_0, (1, 48))


def test_random_q4_k_and_q6_k_blocks_keep_their_stored_parameters() -> None:
    """Random Q4_K blocks: the Q4_K form's codes and factors give int4_groups' scales and
    offsets exactly. Random Q6_K blocks (d at their end): q6k_blocks' values, scales and d
    give what the gguf package dequantizes, bit for bit."""
    from quasar.models.gguf_groups import q4k_codes, q6k_blocks
    from quasar.runtime.w4a8_numerics import dequantize_q6k, q4k_group_params

    gen = np.random.default_rng(7)
    rows, cols = 6, 512
    data = _random_blocks(gen, rows * cols // 256, 144, 2).reshape(rows, -1)
    _, scale, offset = int4_groups(data, T.Q4_K, (rows, cols))
    c, o, d, m = (torch.from_numpy(a) for a in q4k_codes(data, (rows, cols)))
    assert c.dtype == o.dtype == torch.uint8 and d.dtype == m.dtype == torch.float16 and int(c.max()) <= 63
    got_scale, got_offset = q4k_group_params(c, o, d, m)
    assert torch.equal(got_scale, torch.from_numpy(scale)) and torch.equal(got_offset, torch.from_numpy(offset))

    blocks = gen.integers(0, 256, size=(rows * cols // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = gen.uniform(-0.05, 0.05, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    data = blocks.reshape(rows, -1)
    q, s, d = (torch.from_numpy(a) for a in q6k_blocks(data, (rows, cols)))
    assert q.shape == (rows, cols) and int(q.max()) <= 63 and s.dtype == torch.int8 and d.shape == (rows, 2)
    want = torch.from_numpy(dequantize(data, T.Q6_K).reshape(rows, cols).astype(np.float32))
    assert torch.equal(dequantize_q6k(q, s, d), want)
