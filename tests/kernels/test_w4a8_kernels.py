"""The W4A8 GEMM op of the C++ extension (csrc/w4a8_*): bitwise equal to
w4a8_numerics.reference_linear_w4a8 on every kernel path the CPU runs, row-invariant, and
clear about bad arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from quasar.runtime.w4a8_numerics import reference_linear_w4a8

W4_PATHS = ("portable", "avx2", "avx-vnni", "avx512-vnni")  # amx runs the avx512-vnni kernel
FORM_ERROR = r"group size must be 32, 64 or 128 \(or the Q4_K or Q6_K form, 288 or 544\), "


@pytest.fixture(scope="module")
def w4_op():
    from quasar.kernels import ext

    if ext.disabled():
        pytest.skip(f"{ext.ENV_DISABLE} is set")
    op = ext.w4a8_linear_op()
    if op is None:
        toolchain = shutil.which(os.environ.get("CXX", "c++")) is not None
        if toolchain and ext.info().get("state") != "not loaded":
            pytest.fail(f"the W4A8 op is unavailable although a toolchain exists: {ext.info()}")
        pytest.skip("no C++ toolchain")
    return op


@pytest.fixture(params=W4_PATHS)
def w4_path(w4_op, request):
    """The op, once per kernel path this CPU runs, forced as QUASAR_ISA would."""
    from quasar.kernels import ext

    if not ext.cpu_runs(request.param):
        pytest.skip(f"this CPU does not run the {request.param} kernel path")
    with ext.forced_kernel_path(request.param) as path:
        assert path == request.param and ext.w4a8_kernel_path() == request.param
        yield w4_op


def _weights(gen: torch.Generator, n: int, k: int, group: int):
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=gen) / 20).half()
    offsets = (torch.randn(n, k // group, generator=gen) / 20).half()
    return q, scales, offsets


def _pack(q, scales, offsets, group):
    from quasar.kernels import ext

    return ext.pack_w4(q, scales, offsets, group)


CASES = [(k, g) for k in (32, 64, 96, 1536) for g in (32, 64, 128) if k % g == 0]


@pytest.mark.parametrize("k,group", CASES)
def test_bitwise_equal_to_reference_and_row_invariant(w4_path, k: int, group: int) -> None:
    gen = torch.Generator().manual_seed(k + group)
    for n in (19, 40):  # not multiples of 16: a padded last vector
        q, scales, offsets = _weights(gen, n, k, group)
        bias = torch.randn(n, generator=gen)
        packed = _pack(q, scales, offsets, group)
        x = torch.randn(17, k, generator=gen) * torch.logspace(-4, 4, 17)[:, None]
        x[4] = 0.0  # a zero row: q = 0, the smallest scale
        for b in (bias, None):
            want = reference_linear_w4a8(x, q, scales, offsets, b, group)
            for m in (1, 2, 3, 5, 8, 16, 17):
                got = w4_path(x[:m], packed, n, k, group, b)
                assert got.dtype == torch.float32 and got.shape == (m, n)
                assert torch.equal(got, want[:m]), (n, k, group, m, b is not None)
            for i in range(17):  # each row alone is the batched row (row invariance)
                assert torch.equal(w4_path(x[i:i + 1], packed, n, k, group, b), want[i:i + 1]), (n, i)


def test_prefetch_settings_change_no_bit(w4_path) -> None:
    """One-row passes past each thread's first 64 KiB of a weight may leave the stream to the
    hardware prefetcher (ext.prefetch_whole_stream(False)), and every pass that prefetches asks
    ext.w4_prefetch_distance() bytes ahead; a weight of 320 KiB takes every kind of pass, one
    row and three, and any way the outputs are the reference's bits."""
    from quasar.kernels import ext

    gen = torch.Generator().manual_seed(5)
    n, k, group = 520, 1024, 32  # 33 vectors of 10 KiB
    q, scales, offsets = _weights(gen, n, k, group)
    packed = _pack(q, scales, offsets, group)
    x = torch.randn(3, k, generator=gen)
    want = reference_linear_w4a8(x, q, scales, offsets, None, group)
    before, before_distance = ext.prefetch_whole_stream(), ext.w4_prefetch_distance()
    try:
        for whole, distance in ((True, 32 << 10), (False, 32 << 10), (True, 1 << 10), (True, 1 << 20)):
            ext.prefetch_whole_stream(whole)
            ext.w4_prefetch_distance(distance)
            assert ext.prefetch_whole_stream() is whole and ext.w4_prefetch_distance() == distance
            assert torch.equal(w4_path(x, packed, n, k, group, None), want), (whole, distance)
            for i in range(3):
                assert torch.equal(w4_path(x[i:i + 1], packed, n, k, group, None), want[i:i + 1]), (whole, i)
    finally:
        ext.prefetch_whole_stream(before)
        ext.w4_prefetch_distance(before_distance)


@pytest.mark.parametrize("bad", [100, 512, (1 << 20) + 64])
def test_a_prefetch_distance_outside_the_range_is_refused(bad: int) -> None:
    """A distance must be a multiple of 64 bytes in [1 KiB, 1 MiB]; the error names it and the
    setting stays as it was."""
    from quasar.kernels import ext

    if ext.w4a8_linear_op() is None:
        pytest.skip("needs the C++ ops")
    before = ext.w4_prefetch_distance()
    with pytest.raises(RuntimeError, match=f"multiple of 64 bytes.*got {bad}"):
        ext.w4_prefetch_distance(bad)
    assert ext.w4_prefetch_distance() == before


@pytest.mark.parametrize("group", [32, 64, 128])
def test_extremes(w4_path, group: int) -> None:
    """Nibbles all 15 against activations at +-127 (the largest sums, every int16 bound of the
    AVX2 kernel at its limit), nibbles 0, and a zero row."""
    k, n = 1536, 33
    gen = torch.Generator().manual_seed(group)
    q = torch.full((n, k), 15, dtype=torch.int8)
    q[n // 2:] = 0
    q[-1, ::2] = 15  # alternating 15 / 0
    scales = torch.rand(n, k // group, generator=gen).half()
    offsets = torch.randn(n, k // group, generator=gen).half()
    offsets[0, 0] = 2.0 ** -24  # a subnormal float16: widened exactly on every path
    packed = _pack(q, scales, offsets, group)
    x = torch.ones(6, k)
    x[1] = -1.0  # q = -127 everywhere
    x[2, 1::2] = -1.0  # alternating signs
    x[3] = 0.0
    x[4] = torch.randn(k, generator=gen).sign() * 1e30
    x[5, ::7] = -3.0  # q = -127 at the group maxima, smaller elsewhere
    bias = torch.randn(n, generator=gen)
    for b in (bias, None):
        assert torch.equal(w4_path(x, packed, n, k, group, b), reference_linear_w4a8(x, q, scales, offsets, b, group))


def test_activation_rounding_and_non_finite_values(w4_path) -> None:
    """The activation quantizer (vectorized from the AVX2 path up) on its edge cases: ties
    x / s = k + 1/2 round to even, groups below the smallest scale quantize to 0, and a row
    with an inf or a NaN is NaN in every output while the rows beside it are exact."""
    k, n, group = 256, 24, 32
    gen = torch.Generator().manual_seed(11)
    q, scales, offsets = _weights(gen, n, k, group)
    packed = _pack(q, scales, offsets, group)
    x = torch.randn(5, k, generator=gen)
    x[0, :group] = torch.arange(group) - 15.5  # with +-127 below: s = 1, every value a tie
    x[0, 0], x[0, 1] = 127.0, -127.0
    x[0, 2 * group:3 * group] = 1e-20  # amax under 127e-12: the scale is clamped
    x[1, ::3] = 0.5  # ties at every third column once the group's scale is 1
    x[1, 5::group] = 127.0
    want = reference_linear_w4a8(x[:3], q, scales, offsets, None, group)
    x[3, 40] = float("inf")
    x[4, 200] = float("nan")
    got = w4_path(x, packed, n, k, group, None)
    assert torch.equal(got[:3], want)
    assert got[3:].isnan().all()


def _q4k_weights(gen: torch.Generator, n: int, k: int):
    """q, the 6-bit codes c and o (every bit of them used), float16 d and m (m of either sign)."""
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes = [torch.randint(0, 64, (n, k // 32), generator=gen, dtype=torch.uint8) for _ in range(2)]
    supers = [(torch.randn(n, k // 256, generator=gen) / 300).half() for _ in range(2)]
    return q, *codes, *supers


@pytest.mark.parametrize("k", [256, 1536])
def test_q4k_form_bitwise_equal_to_reference(w4_path, k: int) -> None:
    """The Q4_K form (a Q4_K file's own d * c and m * o) gives the reference's bits for those
    exact float32 parameters, for every row count and with a padded last vector; its packing
    streams 4.5 bits a weight, as the file."""
    from quasar.kernels import ext
    from quasar.runtime.w4a8_numerics import Q4K_FORM, q4k_group_params

    gen = torch.Generator().manual_seed(k)
    n = 37
    q, c, o, d, m = _q4k_weights(gen, n, k)
    c[0, 0], o[2, 3], o[1, :] = 63, 63, 0  # the largest codes; a row of zero offsets
    packed = ext.pack_w4_q4k(q, c, o, d, m)
    assert packed.numel() == 3 * 16 * k * 4.5 / 8  # 3 vectors of 16 lanes
    scales, offsets = q4k_group_params(c, o, d, m)
    assert torch.equal(scales, d.float().repeat_interleave(8, 1) * c.float())
    bias = torch.randn(n, generator=gen)
    x = torch.randn(17, k, generator=gen) * torch.logspace(-3, 3, 17)[:, None]
    for b in (bias, None):
        want = reference_linear_w4a8(x, q, scales, offsets, b, 32)
        for rows in (1, 3, 16, 17):
            assert torch.equal(w4_path(x[:rows], packed, n, k, Q4K_FORM, b), want[:rows]), (rows, b is not None)


@pytest.mark.parametrize("k", [256, 1536])
def test_q6k_form_bitwise_equal_to_reference(w4_path, k: int) -> None:
    """The Q6_K form (a Q6_K file's 6-bit values, int8 scales per 16, float16 d per 256) gives
    reference_linear_q6k's bits for every row count, a padded last vector and the extremes
    (values 63 and 0 against activations at +-127, scales -128 and 127: sums past 2**24), and
    its packing streams 6.5625 bits a weight."""
    from quasar.kernels import ext
    from quasar.runtime.w4a8_numerics import Q6K_FORM, reference_linear_q6k

    gen = torch.Generator().manual_seed(k + 6)
    n = 37
    q = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8)
    q[0], q[1] = 63, 0
    sub = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
    sub[0], sub[1] = 127, -128
    d = (torch.rand(n, k // 256, generator=gen) / 100).half()
    packed = ext.pack_w4_q6k(q, sub, d)
    assert packed.numel() == 3 * 16 * k * 6.5625 / 8
    bias = torch.randn(n, generator=gen)
    x = torch.randn(17, k, generator=gen) * torch.logspace(-3, 3, 17)[:, None]
    x[0], x[1] = 1.0, -1.0  # q = +-127 everywhere
    x[2] = 0.0
    for b in (bias, None):
        want = reference_linear_q6k(x, q, sub, d, b)
        for rows in (1, 2, 3, 4, 5, 16, 17):
            assert torch.equal(w4_path(x[:rows], packed, n, k, Q6K_FORM, b), want[:rows]), (rows, b is not None)


def test_q6k_form_errors_name_the_problem(w4_op) -> None:
    from quasar.kernels import ext

    q = torch.randint(0, 64, (16, 256), dtype=torch.uint8)
    sub, d = torch.ones(16, 16, dtype=torch.int8), torch.ones(16, 1).half()
    with pytest.raises(RuntimeError, match=r"multiple of the superblock \(256\)"):
        ext.pack_w4_q6k(q[:, :128], sub[:, :8], d)
    with pytest.raises(RuntimeError, match="sub-block scales must be an int8 CPU tensor, got Byte"):
        ext.pack_w4_q6k(q, sub.to(torch.uint8), d)
    with pytest.raises(RuntimeError, match="6-bit values 0..63"):
        ext.pack_w4_q6k(q + 64, sub, d)


def test_q4k_form_errors_name_the_problem(w4_op) -> None:
    from quasar.kernels import ext
    from quasar.runtime.w4a8_numerics import Q4K_FORM

    gen = torch.Generator().manual_seed(1)
    q, c, o, d, m = _q4k_weights(gen, 16, 256)
    with pytest.raises(RuntimeError, match=r"multiple of the superblock \(256\)"):
        ext.pack_w4_q4k(q[:, :128], c[:, :4], o[:, :4], d, m)
    with pytest.raises(RuntimeError, match="scale codes must be a uint8 CPU tensor, got Half"):
        ext.pack_w4_q4k(q, c.half(), o, d, m)
    with pytest.raises(RuntimeError, match=r"superblock offsets must be \[N, K / 256\] = \[16, 1\]"):
        ext.pack_w4_q4k(q, c, o, d, m[:8])
    with pytest.raises(RuntimeError, match="q must hold 4-bit values 0..15 .found one outside"):
        ext.pack_w4_q4k(q + 16, c, o, d, m)
    with pytest.raises(RuntimeError, match="codes must be 6-bit values 0..63 .found one outside"):
        ext.pack_w4_q4k(q, c, o + 64, d, m)
    with pytest.raises(RuntimeError, match="the Q4_K and Q6_K forms are packed by"):
        ext.pack_w4(q, c.half(), o.half(), Q4K_FORM)
    with pytest.raises(RuntimeError, match=FORM_ERROR + r"got 33"):
        w4_op(torch.randn(1, 256), ext.pack_w4_q4k(q, c, o, d, m), 16, 256, 33, None)


def test_leading_dims_and_uint8_q(w4_op) -> None:
    gen = torch.Generator().manual_seed(5)
    q, scales, offsets = _weights(gen, 24, 64, 32)
    packed = _pack(q, scales, offsets, 32)
    assert torch.equal(packed, _pack(q.to(torch.uint8), scales, offsets, 32))
    x = torch.randn(2, 3, 64, generator=gen)
    got = w4_op(x, packed, 24, 64, 32, None)
    assert got.shape == (2, 3, 24)
    assert torch.equal(got.view(6, 24), reference_linear_w4a8(x.view(6, 64), q, scales, offsets, None, 32))


def test_packed_layout() -> None:
    """The layout csrc/gemm_w4a8/w4a8_gemm.h documents: per vector of 16 rows and group, 64-byte steps
    (byte 4 i + j = q[i][k0 + j] | q[i][k0 + 4 + j] << 4), then 16 float16 scales, then 16
    float16 offsets."""
    from quasar.kernels import ext

    if ext.int8_linear_op() is None:
        pytest.skip("no C++ op")
    gen = torch.Generator().manual_seed(7)
    n, k, group = 18, 64, 32
    q, scales, offsets = _weights(gen, n, k, group)
    packed = _pack(q, scales, offsets, group)
    group_bytes = 8 * group + 64
    assert packed.shape == (2 * 2 * group_bytes,)
    for v in range(2):
        for g in range(2):
            blk = packed[(v * 2 + g) * group_bytes:(v * 2 + g + 1) * group_bytes]
            rows = torch.zeros(16, k, dtype=torch.int8)
            rows[: min(16, n - 16 * v)] = q[16 * v:16 * v + 16]
            cols = rows[:, g * group:(g + 1) * group].view(16, group // 8, 2, 4).to(torch.uint8)
            want = (cols[:, :, 0] | (cols[:, :, 1] << 4)).permute(1, 0, 2).reshape(-1)
            assert torch.equal(blk[:8 * group], want), (v, g)
            lane_s = torch.zeros(16, dtype=torch.float16)
            lane_o = torch.zeros(16, dtype=torch.float16)
            lane_s[: min(16, n - 16 * v)] = scales[16 * v:16 * v + 16, g]
            lane_o[: min(16, n - 16 * v)] = offsets[16 * v:16 * v + 16, g]
            assert torch.equal(blk[8 * group:].view(torch.float16), torch.cat([lane_s, lane_o]))


def test_errors_name_the_problem(w4_op) -> None:
    gen = torch.Generator().manual_seed(3)
    q, scales, offsets = _weights(gen, 20, 128, 32)
    with pytest.raises(RuntimeError, match=FORM_ERROR + r"got 48"):
        _pack(q, scales, offsets, 48)
    with pytest.raises(RuntimeError, match=r"K \(96\) must be a positive multiple of the group size \(64\)"):
        _pack(q[:, :96], scales[:, :1], offsets[:, :1], 64)
    with pytest.raises(RuntimeError, match=r"scales must be \[N, K / group\] = \[20, 4\]"):
        _pack(q, scales[:, :3], offsets, 32)
    with pytest.raises(RuntimeError, match=r"offsets must be \[N, K / group\]"):
        _pack(q, scales, offsets[:19], 32)
    bad = q.clone()
    bad[3, 7] = 16
    with pytest.raises(RuntimeError, match="4-bit values 0..15"):
        _pack(bad, scales, offsets, 32)
    bad[3, 7] = -1
    with pytest.raises(RuntimeError, match="4-bit values 0..15"):
        _pack(bad, scales, offsets, 32)
    with pytest.raises(RuntimeError, match="q must be a 2-D int8 or uint8"):
        _pack(q.float(), scales, offsets, 32)
    with pytest.raises(RuntimeError, match="scales must be a float16 CPU tensor, got Float"):
        _pack(q, scales.float(), offsets, 32)
    packed = _pack(q, scales, offsets, 32)
    x = torch.randn(2, 128)
    with pytest.raises(RuntimeError, match="x has 64 features, the weight K = 128"):
        w4_op(x[:, :64], packed, 20, 128, 32, None)
    with pytest.raises(RuntimeError, match="packed must be w4_pack's uint8"):
        w4_op(x, packed, 20, 128, 64, None)
    with pytest.raises(RuntimeError, match="packed must be w4_pack's uint8"):
        w4_op(x, packed[:-1], 20, 128, 32, None)
    with pytest.raises(RuntimeError, match="bias must have N = 20 elements, got 19"):
        w4_op(x, packed, 20, 128, 32, torch.zeros(19))
    with pytest.raises(RuntimeError, match=FORM_ERROR + r"got 16"):
        w4_op(x, packed, 20, 128, 16, None)


def test_a_wrong_kernel_disables_only_its_path(w4_op) -> None:
    """In a fresh process whose self-check finds the avx2 W4A8 kernel wrong: a warning names
    it, the W4A8 op runs portable where avx2 is forced, and the int8 ops keep avx2."""
    from quasar.kernels import ext

    if not ext.cpu_runs("avx2"):
        pytest.skip("this CPU does not run the avx2 kernel path")
    code = """
import logging
from quasar.kernels import ext
logging.basicConfig(level=logging.WARNING)
real = ext._w4_mismatch
ext._w4_mismatch = lambda path: "forced" if path == "avx2" else real(path)
assert ext.w4a8_linear_op() is not None
with ext.forced_kernel_path("avx2"):
    print(ext.kernel_path(), ext.w4a8_kernel_path(), ",".join(ext.info()["w4a8"]["disabled"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "QUASAR_ISA"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["avx2", "portable", "avx2"]
    assert "the avx2 kernel is wrong (forced); it is disabled, the W4A8 op runs portable instead" in out.stderr
