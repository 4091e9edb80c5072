"""The W4A8 reference numbers (quasar.runtime.w4a8_numerics): the contract W4A8 kernels meet."""

from __future__ import annotations

import pytest
import torch

from quasar.errors import QuasarError
from quasar.runtime.w8a8_numerics import quantize_activation
from quasar.runtime.w4a8_numerics import (MIN_SCALE, activation_group_sums, as_group_params, dequantize_w4, group_sums,
                                        n_groups, pack_int4, quantize_activation_groups, quantize_weight_w4,
                                        quantize_weight_w4_affine, reference_linear_w4a8, scale_output_w4,
                                        symmetric_as_affine, unpack_int4, w4_weight_bytes)


@pytest.mark.parametrize("k, group", [(64, 32), (576, 64), (576, 128), (131, 32), (5, 128)])
def test_quantize_weight_w4_rounds_each_group_to_its_own_scale(k: int, group: int) -> None:
    gen = torch.Generator().manual_seed(k + group)
    w = torch.randn(7, k, generator=gen) * torch.logspace(-2, 1, k)  # scales differ along K
    w[3] = 0.0  # all-zero groups get the floor scale, never 0
    q, s = quantize_weight_w4(w, group)
    assert q.dtype == torch.int8 and q.shape == (7, k) and int(q.abs().max()) <= 7
    assert s.dtype == torch.float16 and s.shape == (7, n_groups(k, group))
    assert torch.all(s[3] == MIN_SCALE) and torch.all(q[3] == 0)
    cols = torch.arange(k) // group
    # q rounds against the stored float16 scale: within half a step of it
    assert torch.all((dequantize_w4(q, s, group) - w).abs() <= s[:, cols].float() / 2 * (1 + 1e-6))
    for g in range(s.shape[1]):  # each group's largest weight maps to ±7
        part = q[[0, 1, 2, 4, 5, 6], g * group:(g + 1) * group]
        assert torch.all(part.abs().amax(dim=1) == 7)


def test_group_sums_are_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    for k, group in ((131, 32), (1536, 128), (64, 64)):
        qx = torch.randint(-127, 128, (5, k), generator=gen, dtype=torch.int8)
        qx[0] = 127
        q = torch.randint(-7, 8, (9, k), generator=gen, dtype=torch.int8)
        q[0] = -7
        got = group_sums(qx, q, group)
        want = torch.zeros(5, 9, n_groups(k, group), dtype=torch.int64)
        for g in range(want.shape[2]):
            cols = slice(g * group, min(k, (g + 1) * group))
            want[:, :, g] = qx[:, cols].long() @ q[:, cols].long().t()
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)


def test_epilogue_adds_groups_in_order_without_fma() -> None:
    """Summing the groups in another order or fusing the multiply-add changes some bits:
    the reference pins one order, which kernels must follow."""
    gen = torch.Generator().manual_seed(1)
    sums = torch.randint(-100_000, 100_000, (64, 64, 12), generator=gen, dtype=torch.int32)
    x_sums = torch.randint(-2_000, 2_000, (64, 12), generator=gen, dtype=torch.int32)
    scales, offsets = torch.rand(64, 12, generator=gen) / 1000, -torch.rand(64, 12, generator=gen) / 100
    sx = torch.rand(64, 12, generator=gen)
    y = scale_output_w4(sums, x_sums, sx, scales, offsets, None)

    def in_order(groups):
        acc = torch.zeros(64, 64)
        for g in groups:
            acc = acc + (sums[:, :, g].float() * sx[:, g:g + 1]) * scales[:, g]
            acc = acc + (x_sums[:, g:g + 1].float() * sx[:, g:g + 1]) * offsets[:, g]
        return acc

    assert torch.equal(y, in_order(range(12)))
    assert not torch.equal(y, in_order(reversed(range(12))))


def _affine(gen: torch.Generator, n: int, k: int, group: int):
    q, s = quantize_weight_w4(torch.randn(n, k, generator=gen), group)
    return symmetric_as_affine(q, s)


def test_rows_are_batch_independent() -> None:
    gen = torch.Generator().manual_seed(2)
    q, s, o = _affine(gen, 48, 200, 64)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(9, 200, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    y = reference_linear_w4a8(x, q, s, o, bias, 64)
    for i in range(9):
        assert torch.equal(reference_linear_w4a8(x[i:i + 1], q, s, o, bias, 64), y[i:i + 1])


def test_symmetric_as_affine_is_the_same_weights() -> None:
    gen = torch.Generator().manual_seed(7)
    q, s = quantize_weight_w4(torch.randn(5, 96, generator=gen), 32)
    qa, sa, oa = symmetric_as_affine(q, s)
    assert int(qa.min()) >= 1 and int(qa.max()) <= 15
    cols = torch.arange(96) // 32  # the same real numbers (float64 holds both exactly)
    assert torch.equal(qa.double() * sa.double()[:, cols] + oa.double()[:, cols], q.double() * s.double()[:, cols])


@pytest.mark.parametrize("k, group", [(64, 32), (200, 32), (256, 128)])
def test_activation_groups_each_take_their_own_range(k: int, group: int) -> None:
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(4, k, generator=gen) * torch.logspace(-3, 3, k)  # ranges differ along K
    x[2] = 0.0
    q, sx = quantize_activation_groups(x, group)
    assert q.shape == (4, k) and sx.shape == (4, n_groups(k, group))
    for g in range(sx.shape[1]):
        cols = slice(g * group, min(k, (g + 1) * group))
        q1, s1 = quantize_activation(x[:, cols])
        assert torch.equal(q[:, cols], q1) and torch.equal(sx[:, g:g + 1], s1)


def test_smaller_groups_are_closer_to_the_float_layer() -> None:
    """The trade issue #34 asks to measure: finer groups, smaller error (and more scale bytes)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 1024, generator=gen) * (1 + 4 * torch.rand(1, 1024, generator=gen))  # outlier columns
    x = torch.randn(16, 1024, generator=gen)
    ref = x @ w.t()
    errors = []
    for group in (32, 64, 128, 1024):
        q, s, o = symmetric_as_affine(*quantize_weight_w4(w, group))
        y = reference_linear_w4a8(x, q, s, o, None, group)
        errors.append(float((y - ref).norm() / ref.norm()))
    assert errors == sorted(errors) and errors[0] < 0.15, errors
    qx, sx = quantize_activation(x)
    assert errors[0] > float((qx.float() * sx - x).norm() / x.norm())  # weights, not activations, dominate


@pytest.mark.parametrize("k", [1, 2, 7, 64, 131])
def test_pack_int4_round_trip_and_layout(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    q = torch.randint(0, 16, (3, k), generator=gen, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, (k + 1) // 2)
    assert torch.equal(unpack_int4(packed, k), q)
    assert int(packed[0, 0]) & 15 == int(q[0, 0])  # column 0 in the low nibble
    if k > 1:
        assert int(packed[0, 0]) >> 4 == int(q[0, 1])
    if k % 2:
        assert int(packed[0, -1]) >> 4 == 0


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(QuasarError, match="group size"):
        quantize_weight_w4(torch.randn(2, 8), 0)
    with pytest.raises(QuasarError, match="2-D float"):
        quantize_weight_w4(torch.randn(8), 32)
    with pytest.raises(QuasarError, match=r"\[0, 15\]"):
        pack_int4(torch.full((1, 2), -1, dtype=torch.int8))
    with pytest.raises(QuasarError, match="columns"):
        group_sums(torch.zeros(1, 4, dtype=torch.int8), torch.zeros(1, 5, dtype=torch.int8), 4)
    with pytest.raises(QuasarError, match="uint8"):
        unpack_int4(torch.zeros(1, 2, dtype=torch.uint8), 5)
    with pytest.raises(QuasarError, match="2-D"):
        quantize_activation_groups(torch.zeros(3), 32)


def test_weight_bytes() -> None:
    # 1.5B's MLP down projection at group 64: 4 bits + 32 / 64 bits of float16 scale and offset a weight
    assert w4_weight_bytes(1536, 8960, 64) == 1536 * (4480 + 140 * 4)
    assert w4_weight_bytes(1, 3, 2, scale_bytes=4) == 2 + 2 * 2 * 4
    assert w4_weight_bytes(1536, 8960 // 256 * 256, 32, q4k=True) * 8 == 1536 * 8960 // 256 * 256 * 4.5


def test_group_params_are_float16_and_overflow_is_an_error() -> None:
    t = torch.tensor([[0.1, -3.0, 2.0 ** -24]])
    h = as_group_params(t)
    assert h.dtype == torch.float16 and torch.equal(h, t.half())
    with pytest.raises(QuasarError, match=r"offsets must be finite float16.*7e\+04"):
        as_group_params(torch.tensor([[70000.0]]), "offsets")
    # the affine quantizer rounds its offset (the group minimum) to float16 first, then q against it
    w = torch.tensor([[0.1001, 0.2, 0.3, 0.7]])
    q, s, o = quantize_weight_w4_affine(w, 32)
    assert s.dtype == o.dtype == torch.float16 and float(o) == float(torch.tensor(0.1001).half())
    assert torch.all((dequantize_w4(q, s, 32, o) - w).abs() <= float(s) / 2 * (1 + 1e-6))


def _gguf_like(gen: torch.Generator, n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights on a 4-bit affine grid per group, as a Q4_1 / Q4_K file stores them: d * q + m
    with d, m fp16 values and q in [0, 15] using both ends of the range."""
    g = n_groups(k, group)
    q = torch.randint(0, 16, (n, g * group), generator=gen, dtype=torch.int8)
    q[:, 0::group], q[:, 1::group] = 0, 15
    d = (torch.rand(n, g, generator=gen) / 50 + 1e-3).half().float()
    m = (-torch.rand(n, g, generator=gen) / 10).half().float()
    return q[:, :k].contiguous(), d, m


@pytest.mark.parametrize("k, group", [(576, 32), (1536, 32), (96, 64)])
def test_affine_groups_keep_a_4bit_files_weights(k: int, group: int) -> None:
    """A model read from a 4-bit GGUF is already on an affine grid per 32 weights: the affine
    quantizer gives those weights back instead of rounding them again (the symmetric one
    cannot: its grid is centred on zero)."""
    gen = torch.Generator().manual_seed(k)
    q, d, m = _gguf_like(gen, 24, k, group)
    w = dequantize_w4(q, d, group, m)
    q2, d2, m2 = quantize_weight_w4_affine(w, group)
    assert torch.equal(q2, q)
    assert torch.allclose(dequantize_w4(q2, d2, group, m2), w, rtol=0, atol=1e-6)
    qs, ss = quantize_weight_w4(w, group)
    assert float((dequantize_w4(qs, ss, group) - w).abs().max()) > 1e-3


def test_affine_product_is_exact_and_rows_independent() -> None:
    gen = torch.Generator().manual_seed(5)
    k, group = 200, 32  # a ragged last group
    w = torch.randn(40, k, generator=gen)
    q, s, o = quantize_weight_w4_affine(w, group)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    x = torch.randn(6, k, generator=gen) * torch.logspace(-2, 2, 6)[:, None]
    y = reference_linear_w4a8(x, q, s, o, None, group)
    qx, sx = quantize_activation_groups(x, group)
    xd = qx.double() * sx.double().repeat_interleave(group, dim=1)[:, :k]
    exact = xd @ dequantize_w4(q, s, group, o).double().t()
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
    assert torch.equal(activation_group_sums(qx, group).long(),
                       torch.stack([qx[:, i:i + group].long().sum(1) for i in range(0, k, group)], 1))
    for i in range(6):
        assert torch.equal(reference_linear_w4a8(x[i:i + 1], q, s, o, None, group), y[i:i + 1])


@pytest.mark.parametrize("k, group", [(576, 32), (1536, 32), (200, 32)])
def test_fitted_groups_beat_min_max_and_keep_a_4bit_grid(k: int, group: int) -> None:
    """``fit_weight_w4_affine``: on Gaussian weights (a ragged last group at K=200) its weighted
    error is below the min-max quantizer's (0.80x measured), it stays in the stored form (q in [0, 15],
    float16 scales and offsets), and weights already on a 4-bit grid come back exactly."""
    from quasar.runtime.w4a8_numerics import fit_weight_w4_affine

    gen = torch.Generator().manual_seed(k)
    w = torch.randn(32, k, generator=gen) * torch.logspace(-2, 0, 32)[:, None]

    def weighted_error(q, s, o):
        g = n_groups(k, group)
        pad = g * group - k
        w3 = torch.nn.functional.pad(w, (0, pad)).view(32, g, group)
        real = (torch.arange(g * group) < k).view(1, g, group)
        rms = (w3.square().sum(2, keepdim=True) / real.sum(2, keepdim=True)).sqrt()
        c = torch.where(real, rms + w3.abs(), 0.0)
        d = torch.nn.functional.pad(dequantize_w4(q, s, group, o) - w, (0, pad)).view(32, g, group)
        return float((c * d.square()).sum())

    fitted = fit_weight_w4_affine(w, group)
    q, s, o = fitted
    assert q.dtype == torch.int8 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert s.dtype == o.dtype == torch.float16 and q.shape == w.shape
    assert weighted_error(*fitted) < 0.9 * weighted_error(*quantize_weight_w4_affine(w, group))
    qg, d, m = _gguf_like(gen, 24, k, group)
    on_grid = dequantize_w4(qg, d, group, m)
    q2, d2, m2 = fit_weight_w4_affine(on_grid, group)
    assert torch.equal(dequantize_w4(q2, d2, group, m2), on_grid)


def test_the_q6k_reference_is_the_float_product_of_its_rounded_activations() -> None:
    """reference_linear_q6k's integer sums are x's per-group int8 activations against the
    dequantized Q6_K weight, exactly (up to the float32 epilogue's rounding)."""
    from quasar.runtime.w4a8_numerics import dequantize_q6k, reference_linear_q6k

    gen = torch.Generator().manual_seed(6)
    n, k = 24, 512
    q = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8)
    sub = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
    d = (torch.rand(n, k // 256, generator=gen) / 100).half()
    x, bias = torch.randn(5, k, generator=gen), torch.randn(n, generator=gen)
    qx, sx = quantize_activation_groups(x, 32)
    xq = (qx.double().view(5, -1, 32) * sx.double()[..., None]).view(5, k)
    want = xq @ dequantize_q6k(q, sub, d).double().T + bias.double()
    got = reference_linear_q6k(x, q, sub, d, bias)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
