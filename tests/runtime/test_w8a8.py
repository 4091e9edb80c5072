"""Int8 GEMM backends are exact, and Int8Linear keeps a token's result batch-independent."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from quasar.errors import QuasarError
from quasar.runtime import w8a8_backends as kernels
from quasar.runtime.w8a8 import Int8Linear, set_backend
from quasar.runtime.w8a8_numerics import quantize_activation, quantize_weight, reference_mm, scale_output

SHAPES = [(1, 1), (3, 5), (64, 48), (131, 37), (577, 193), (1100, 70)]  # (K, N)
CUDA = torch.cuda.is_available()


def _int8(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random int8 with whole rows at the -128 / 127 extremes (int16-saturation bait)."""
    t = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    t[0] = -128
    if shape[0] > 2:
        t[1] = 127
    return t


def _exact(qx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (qx.long() @ w.long().t()).to(torch.int32)


def _layer(
    k: int, n: int, bias: bool = True, backend: str = "cpu", seed: int = 0
) -> tuple[nn.Linear, Int8Linear]:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin, Int8Linear.from_float(lin, backend=backend)


def _gemm_cases():
    gen = torch.Generator().manual_seed(1)
    for k, n in SHAPES:
        w = _int8(gen, n, k)
        for m in range(1, 9):
            yield _int8(gen, m, k), w


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_backend_gemm_is_exact(backend: str) -> None:
    kernel = kernels.get_kernel(backend)
    for qx, w in _gemm_cases():
        got = kernel.mm(qx, kernel.pack(w))
        assert got.dtype == torch.int32 and got.shape == (qx.shape[0], w.shape[0])
        assert torch.equal(got, _exact(qx, w)), (qx.shape, w.shape)


def test_every_cpu_variant_is_exact() -> None:
    """Every oneDNN variant kept is exact here (on a CPU without VNNI none is: its int16 pairs
    saturate), and the C++ op lets oneDNN serve long steps only where s8 is."""
    from quasar.kernels import ext

    if ext.int8_linear_op() is not None:
        kernels.cpu_fused(kernels.cpu_pack(torch.ones(3, 8, dtype=torch.int8)))  # tells the op
        assert ext.onednn_exact() == ("s8" in kernels.exact_cpu_variants())
    for name in kernels.exact_cpu_variants():
        pack, mm = kernels.CPU_VARIANTS[name]
        for qx, w in _gemm_cases():
            if qx.shape[1] > 1:  # K == 1 is routed to the reference by the cpu backend
                assert torch.equal(mm(qx, pack(w)), _exact(qx, w)), (name, qx.shape, w.shape)


def test_saturating_variant_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    def saturating_mm(qx: torch.Tensor, packed: tuple) -> torch.Tensor:
        # Pairwise u8 x s8 products summed in int16 with saturation, like pre-VNNI AVX2.
        ux = qx.long() + 128
        w = packed[0].long()
        k = ux.shape[1] // 2 * 2
        prod = ux[:, None, :k] * w[None, :, :k]
        pairs = (prod[..., 0::2] + prod[..., 1::2]).clamp(-32768, 32767)
        rest = (ux[:, None, k:] * w[None, :, k:]).sum(-1)
        comp = 128 * w.sum(1)
        return (pairs.sum(-1) + rest - comp).to(torch.int32)

    monkeypatch.setitem(kernels.CPU_VARIANTS, "bad", (kernels.s8_pack, saturating_mm))
    assert not kernels._variant_exact("bad")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_gemm_is_exact() -> None:
    kernel = kernels.get_kernel("cuda")
    for qx, w in _gemm_cases():
        got = kernel.mm(qx.cuda(), kernel.pack(w.cuda())).cpu()
        assert torch.equal(got, _exact(qx, w)), (qx.shape, w.shape)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_layer_rows_are_batch_independent() -> None:
    _, layer = _layer(577, 193, backend="cuda")
    layer.cuda()
    x = torch.randn(6, 577, device="cuda")
    y = layer(x)
    for i in range(6):
        assert torch.equal(layer(x[i : i + 1]), y[i : i + 1])


def test_quantize_weight() -> None:
    w = torch.randn(5, 33)
    w[2] = 0
    q, s = quantize_weight(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5, 1)
    assert q.abs().amax(1).tolist() == [127, 127, 0, 127, 127]
    assert s[2].item() == 1.0
    assert torch.all((q.float() * s - w).abs() <= s / 2 + 1e-7)


def test_quantize_activation_rows_are_independent() -> None:
    x = torch.randn(6, 100) * torch.logspace(-3, 3, 6)[:, None]
    x[3] = 0
    q, s = quantize_activation(x)
    assert q.dtype == torch.int8 and s.shape == (6, 1)
    assert q[3].abs().sum() == 0 and torch.isfinite(s).all()
    assert q.abs().amax(1).tolist() == [127, 127, 127, 0, 127, 127]
    for i in range(6):
        qi, si = quantize_activation(x[i : i + 1])
        assert torch.equal(qi, q[i : i + 1]) and torch.equal(si, s[i : i + 1])


@pytest.mark.parametrize("k,n", [(576, 192), (577, 193), (1536, 576)])
def test_layer_rows_are_batch_independent(k: int, n: int) -> None:
    _, layer = _layer(k, n)
    x = torch.randn(6, k)
    y = layer(x)
    for i in range(6):
        assert torch.equal(layer(x[i : i + 1]), y[i : i + 1])
    assert torch.equal(layer(x.view(2, 3, k)), y.view(2, 3, n))
    # Every backend on a device gives the same bits: only the GEMM differs, and it is exact.
    set_backend(layer, "reference")
    assert torch.equal(layer(x), y)


def test_layer_is_close_to_float() -> None:
    lin, layer = _layer(576, 1536)
    x = torch.randn(6, 576)
    with torch.no_grad():
        ref = lin(x)
    y = layer(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert ((y - ref).norm() / ref.norm()).item() < 0.02
    y16 = layer(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    assert ((y16.float() - ref).norm() / ref.norm()).item() < 0.02


def test_bias_is_added_last() -> None:
    lin, with_bias = _layer(64, 48)
    no_bias = Int8Linear.from_float(nn.Linear(64, 48, bias=False), backend="cpu")
    no_bias.weight.copy_(with_bias.weight)
    no_bias.weight_scale.copy_(with_bias.weight_scale)
    x = torch.randn(3, 64)
    assert torch.equal(with_bias(x), no_bias(x) + lin.bias.detach())
    assert "bias" not in no_bias.state_dict()


def test_state_dict_round_trip_rebuilds_packed() -> None:
    _, layer = _layer(577, 193)
    x = torch.randn(6, 577)
    y = layer(x)
    sd = layer.state_dict()
    assert list(sd) == ["weight", "weight_scale", "bias"]
    assert sd["weight"].dtype == torch.int8 and sd["weight"].shape == (193, 577)
    assert sd["weight_scale"].dtype == torch.float32 and sd["weight_scale"].shape == (193, 1)

    _, fresh = _layer(577, 193, seed=1)
    parent = nn.Sequential(fresh)
    assert not torch.equal(fresh(x), y)  # packs the old weights
    parent.load_state_dict({f"0.{k}": v.clone() for k, v in sd.items()})
    assert torch.equal(fresh(x), y)


def test_weight_edits_repack() -> None:
    _, layer = _layer(64, 48)
    x = torch.randn(2, 64)
    y = layer(x)
    flipped = Int8Linear(64, 48, backend="cpu")
    flipped.load_state_dict(layer.state_dict())
    with torch.no_grad():
        flipped.weight.neg_()
    y_flipped = flipped(x)
    with torch.no_grad():
        layer.weight.neg_()  # in place: the version counter changes
    assert torch.equal(layer(x), y_flipped) and not torch.equal(y_flipped, y)
    layer.weight = layer.weight.neg()  # reassignment: a new tensor
    assert torch.equal(layer(x), y)


def test_inference_mode_tensors() -> None:
    """Inference tensors keep no version counter; loading still rebuilds the packed data."""
    with torch.inference_mode():
        _, layer = _layer(64, 48)
        x = torch.randn(1, 64)
        y = layer(x)
        fresh = Int8Linear(64, 48, backend="cpu")
        fresh(x)
        fresh.load_state_dict(layer.state_dict())
        assert torch.equal(fresh(x), y)


def test_user_errors_raise_quasar_error() -> None:
    _, layer = _layer(64, 48)
    with pytest.raises(QuasarError):
        layer(torch.randn(2, 65))
    with pytest.raises(QuasarError):
        layer(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(QuasarError):
        set_backend(layer, "tpu")
    with pytest.raises(QuasarError):
        Int8Linear.from_float(nn.Conv1d(2, 2, 1))  # type: ignore[arg-type]
    if not CUDA:
        with pytest.raises(QuasarError):
            set_backend(layer, "cuda")
    assert set_backend(nn.Sequential(layer, nn.ReLU(), _layer(8, 4)[1]), "auto") == 2


# ---------------------------------------------------------------- C++ fast path (ext)
def _toolchain() -> bool:
    import os
    import shutil

    return os.name == "posix" and shutil.which(os.environ.get("CXX", "c++")) is not None and (
        shutil.which("ninja") is not None or _pip_ninja()
    )


def _pip_ninja() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def ext_op():
    """The C++ op; it must build wherever a toolchain exists (else the test is skipped)."""
    from quasar.kernels import ext

    if ext.disabled():
        pytest.skip(f"{ext.ENV_DISABLE} is set")
    op = ext.int8_linear_op()
    if op is None:
        if _toolchain():
            pytest.fail(f"C++ extension failed although a toolchain exists: {ext.info()}")
        pytest.skip("no C++ toolchain")
    return op


def _without_ext(layer: Int8Linear, monkeypatch: pytest.MonkeyPatch) -> Int8Linear:
    """A copy of ``layer`` packed with QUASAR_NO_EXT=1 (the pure-PyTorch cpu path)."""
    twin = Int8Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                      backend=layer.backend)
    twin.load_state_dict(layer.state_dict())
    with monkeypatch.context() as m:
        m.setenv("QUASAR_NO_EXT", "1")
        assert twin.repack()[5] is None
    return twin


def _hard_rows(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows across 8 decades plus zero, tiny (clamped-scale) and ±127-boundary rows."""
    x = torch.randn(m, k) * torch.logspace(-4, 4, m)[:, None]
    if m >= 4:
        x[1] = 0
        x[2] = 1e-20 if dtype == torch.float32 else 0
        x[3, ::2] = 127.5 / 127  # halves: round-half-even matters
    return x.to(dtype)


@pytest.mark.parametrize("k,n", [(2, 3), (64, 48), (131, 37), (576, 192), (577, 193), (1536, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_ext_is_bitwise_equal_to_pytorch_path(ext_op, monkeypatch, k: int, n: int, bias: bool) -> None:
    _, layer = _layer(k, n, bias=bias)
    assert layer.repack()[5] is not None  # the fast path is in use
    plain = _without_ext(layer, monkeypatch)
    ref = Int8Linear.from_float(nn.Linear(k, n, bias=bias), backend="reference")
    ref.load_state_dict(layer.state_dict())
    for m in (1, 2, 5, 6, 17):
        for dtype in (torch.float32, torch.bfloat16):
            x = _hard_rows(m, k, dtype)
            y = layer(x)
            assert y.dtype == dtype and y.shape == (m, n)
            assert torch.equal(y, plain(x)), (m, dtype)
            assert torch.equal(y, ref(x)), (m, dtype)


def test_ext_rows_are_batch_independent(ext_op) -> None:
    _, layer = _layer(576, 1536)
    assert layer.repack()[5] is not None
    x = torch.randn(6, 576) * torch.logspace(-2, 2, 6)[:, None]
    y = layer(x)  # M > 1: the small-M VNNI kernel, else s8 x s8
    for i in range(6):
        assert torch.equal(layer(x[i : i + 1]), y[i : i + 1])  # M = 1: u8 x s8 GEMV
    assert torch.equal(layer(x.view(2, 3, 576)), y.view(2, 3, 1536))
    assert torch.equal(layer(torch.cat([x, x], 1)[:, ::2]), layer(torch.cat([x, x], 1)[:, ::2].contiguous()))


def test_ext_edge_cases(ext_op, monkeypatch) -> None:
    # K == 1: torch's CPU _int_mm is broken there; the op computes it (its own kernel, float64
    # past the small-M rows), exactly.
    _, k1 = _layer(1, 5)
    assert k1.repack()[5] is not None
    x = torch.randn(3, 1)
    assert torch.equal(k1(x), _without_ext(k1, monkeypatch)(x))
    # The op itself, on variants the policy does not pick: K == 1, u8 x s8 for M > 1.
    for k, m in ((1, 3), (577, 6)):
        _, ref = _layer(k, 7, backend="reference")
        x = torch.randn(m, k)
        comp = ref.weight.sum(dim=1, dtype=torch.int32).mul_(128)
        for u8 in (False, True):
            got = ext_op(x, ref.weight, ref.weight_scale, ref.bias, comp, u8, u8)
            assert torch.equal(got, ref(x)), (k, m, u8)
    _, layer = _layer(64, 48)
    plain = _without_ext(layer, monkeypatch)
    # Non-finite inputs give the same NaN / inf pattern.
    x = torch.randn(4, 64)
    x[0, 3], x[1, 5], x[2, 7] = float("inf"), float("nan"), -float("inf")
    assert torch.equal(layer(x).nan_to_num(), plain(x).nan_to_num())
    # Grad-requiring inputs take the PyTorch path (the op has no autograd kernel).
    xg = torch.randn(2, 64, requires_grad=True)
    assert torch.equal(layer(xg).detach(), plain(xg.detach()))
    # An edited weight_scale / bias is read at every call, as on the PyTorch path.
    with torch.no_grad():
        layer.weight_scale.mul_(2)
        layer.bias.add_(1)
        plain.weight_scale.mul_(2)
        plain.bias.add_(1)
    x = torch.randn(3, 64)
    assert torch.equal(layer(x[:1]), plain(x[:1])) and torch.equal(layer(x), plain(x))


def test_ext_disabled_by_env(monkeypatch) -> None:
    from quasar.kernels import ext

    monkeypatch.setenv("QUASAR_NO_EXT", "1")
    assert ext.disabled() and ext.int8_linear_op() is None
    _, layer = _layer(577, 193)
    assert layer.repack()[5] is None  # pure-PyTorch cpu path
    monkeypatch.setenv("QUASAR_NO_EXT", "0")
    assert not ext.disabled()


def _fresh_ext(monkeypatch: pytest.MonkeyPatch, cache) -> object:
    """ext with no load attempted yet, caching under ``cache``, library not registered."""
    from quasar.kernels import ext

    monkeypatch.setenv("QUASAR_CACHE", str(cache))
    monkeypatch.delenv("QUASAR_NO_EXT", raising=False)
    monkeypatch.setattr(ext, "_info", {})
    monkeypatch.setattr(ext, "_op", None)
    monkeypatch.setattr(ext, "_registered", lambda: False)
    return ext


def test_ext_falls_back_without_compiler(monkeypatch, tmp_path) -> None:
    ext = _fresh_ext(monkeypatch, tmp_path)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert ext.int8_linear_op() is None
    assert ext.info()["state"] == "failed" and "compiler" in ext.info()["error"]
    assert not (ext.build_dir() / "FAILED").exists()  # a later toolchain is picked up
    lin, layer = _layer(64, 48)
    assert layer.repack()[5] is None
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert ((layer(x) - lin(x)).norm() / lin(x).norm()).item() < 0.05


def test_ext_failed_build_is_recorded(monkeypatch, tmp_path) -> None:
    ext = _fresh_ext(monkeypatch, tmp_path)
    calls = []

    def broken_build(build_directory, env_path) -> None:
        calls.append(build_directory)
        raise RuntimeError("error: something.h: No such file or directory")

    monkeypatch.setattr(ext, "_toolchain_path", lambda: "")
    monkeypatch.setattr(ext, "_build", broken_build)
    assert ext.int8_linear_op() is None and len(calls) == 1
    assert "No such file" in (ext.build_dir() / "FAILED").read_text()
    assert not list(ext.build_dir().glob("build-*")) and not (ext.build_dir() / "int8_linear.so").exists()
    monkeypatch.setattr(ext, "_info", {})  # a new process: does not try again
    assert ext.int8_linear_op() is None and len(calls) == 1


def test_ext_concurrent_builds_build_once(monkeypatch, tmp_path) -> None:
    import os
    import threading
    import time

    if os.name != "posix":
        pytest.skip("file locks are POSIX-only")
    ext = _fresh_ext(monkeypatch, tmp_path)
    builds, loads = [], []

    def slow_build(build_directory, env_path) -> None:
        builds.append(build_directory)
        (build_directory / "int8_linear.so").write_bytes(b"x" * 1000)
        time.sleep(0.5)

    monkeypatch.setattr(ext, "_toolchain_path", lambda: "")
    monkeypatch.setattr(ext, "_build", slow_build)
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    so = ext.build_dir() / "int8_linear.so"
    states: list[str] = []
    threads = [threading.Thread(target=lambda: states.append(ext._load_or_build(so))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and sorted(states) == ["built", "cache", "cache"]
    assert loads == [str(so), str(so)] and so.read_bytes() == b"x" * 1000
    assert sorted(p.name for p in so.parent.iterdir()) == ["int8_linear.so", "lock"]


def test_ext_later_processes_load_from_cache(ext_op) -> None:
    import subprocess
    import sys

    code = (
        "from quasar.kernels import ext; op = ext.int8_linear_op(); i = ext.info(); "
        "print(i['state'], i['seconds'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    state, seconds = out.stdout.split()
    assert state == "cache" and float(seconds) < 1.0, out.stdout
    assert out.stderr == ""


# ---------------------------------------------------------------- small-M kernel (ext), every path
def _kernel_path_params():
    from quasar.kernels.ext import KERNEL_PATHS

    return list(KERNEL_PATHS)


@pytest.fixture(params=_kernel_path_params())
def small_m(ext_op, request):
    """The op with its small-M kernel on, once per kernel path this CPU runs (portable, avx2,
    avx-vnni, avx512-vnni, amx; the others are skipped), forced as QUASAR_ISA would; the
    threshold and the path are restored afterwards."""
    from quasar.kernels import ext

    if not ext.cpu_runs(request.param):
        pytest.skip(f"this CPU does not run the {request.param} kernel path")
    with ext.forced_kernel_path(request.param) as path:
        assert path == request.param
        old = ext.small_m_max(16)
        yield ext_op
        ext.small_m_max(old)


def _op_reference(x, w, ws, bias) -> torch.Tensor:
    qx, sx = quantize_activation(x)
    return scale_output(reference_mm(qx, (w,)), sx, ws, bias, torch.float32)


@pytest.mark.parametrize("k", [1, 2, 63, 64, 65, 577, 1536])
def test_small_m_kernel_is_bitwise_equal_to_reference(small_m, k: int) -> None:
    from quasar.kernels import ext

    gen = torch.Generator().manual_seed(k)
    for n in (1, 7, 65, 193):
        w = _int8(gen, n, k)  # rows of -128 and 127
        if n == 65:  # symmetric weights, as Quasar quantizes them: AVX2's shorter form
            w.clamp_(min=-127)
        ws = torch.rand(n, 1, generator=gen) / 100
        bias = torch.randn(n, generator=gen)
        comp = w.sum(dim=1, dtype=torch.int32).mul_(128)
        tiles = ext.pack_tiles(w)
        for m in range(1, 17):  # 7..16: more than one pass over each tile
            x = _hard_rows(m, k, torch.float32)
            x[0] = torch.where(torch.arange(k) % 2 == 0, 3.0, -3.0)  # q = ±127: u8 255 / 1
            for b in (bias, None):
                want = _op_reference(x, w, ws, b)
                got = small_m(x, w, ws, b, comp, True, False, tiles)
                assert torch.equal(got, want), (k, n, m, b is None)
                if k > 1:  # oneDNN (the old path) agrees bit for bit
                    assert torch.equal(small_m(x, w, ws, b, comp, True, False), got)  # no tiles
                    old = ext.small_m_max(0)
                    try:
                        assert torch.equal(small_m(x, w, ws, b, comp, True, False, tiles), got)
                    finally:
                        ext.small_m_max(old)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_small_m_threads_may_share_a_tile(small_m, threads: int) -> None:
    """Threads split a GEMM by vectors of 16 outputs, so two may share a 64-row weight tile
    (37 vectors over 2 threads: 18 / 19); every output is still bitwise the reference's,
    VNNI and AMX alike (1..20 rows, two blocks of rows past 16). Several rows fetch the
    thread's next tile ahead (AVX2, AVX-VNNI), and one-row passes past each thread's first 64 KiB
    may leave the stream to the hardware prefetcher (prefetch_whole_stream(False)): no bit
    changes either way."""
    from quasar.kernels import ext

    old_threads, old_max, old_whole = torch.get_num_threads(), ext.small_m_max(32), ext.prefetch_whole_stream()
    gen = torch.Generator().manual_seed(threads)
    k = 4096  # a task as small as one vector (the grain: ~64 KiB of weights)
    try:
        torch.set_num_threads(threads)
        for n in (80, 592):
            w = _int8(gen, n, k)
            if n == 592:
                w.clamp_(min=-127)  # AVX2's symmetric form
            ws = torch.rand(n, 1, generator=gen) / 100
            comp = w.sum(dim=1, dtype=torch.int32).mul_(128)
            tiles = ext.pack_tiles(w)
            for m in (1, 5, 16, 20):
                x = torch.randn(m, k, generator=gen)
                want = _op_reference(x, w, ws, None)
                for whole in (True, False):
                    ext.prefetch_whole_stream(whole)
                    assert torch.equal(small_m(x, w, ws, None, comp, True, False, tiles), want), (n, m, whole)
    finally:
        torch.set_num_threads(old_threads)
        ext.small_m_max(old_max)
        ext.prefetch_whole_stream(old_whole)


def test_ext_parallel_loops_use_torch_threads(ext_op) -> None:
    """The op's at::parallel_for really runs on torch's intra-op threads: built without
    OpenMP it would quietly run every GEMM and attention loop on one core."""
    import os

    from quasar.kernels import ext

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs at least 2 CPUs")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ext.parallel_threads() == 2
        torch.set_num_threads(1)
        assert ext.parallel_threads() == 1
    finally:
        torch.set_num_threads(old)


def test_small_m_kernel_wraps_exactly(small_m) -> None:
    """Past K = 65793 the u8 sums overflow int32; minus comp the result is still exact."""
    from quasar.kernels import ext

    k, n = 70001, 3
    w = torch.full((n, k), -128, dtype=torch.int8)
    w[1] = 127
    w[2, ::2] = 5
    ws = torch.full((n, 1), 1e-6)
    comp = w.sum(dim=1, dtype=torch.int32).mul_(128)
    x = torch.ones(2, k)
    x[1, 1::3] = -1
    got = small_m(x, w, ws, None, comp, True, True, ext.pack_tiles(w))
    assert torch.equal(got, _op_reference(x, w, ws, None))


def test_small_m_rows_are_batch_independent(small_m) -> None:
    _, layer = _layer(577, 1539)
    assert layer.repack()[5] is not None
    x = torch.randn(17, 577) * torch.logspace(-3, 3, 17)[:, None]
    y = layer(x)  # M = 17: oneDNN
    for m in range(1, 9):  # every small M, every row position
        for i in range(0, 17 - m + 1, 3):
            assert torch.equal(layer(x[i : i + m]), y[i : i + m]), (m, i)
    set_backend(layer, "reference")
    assert torch.equal(layer(x[:6]), y[:6])


def test_small_m_kernel_can_be_disabled(small_m, monkeypatch) -> None:
    from quasar.kernels import ext

    _, layer = _layer(576, 192)
    plain = _without_ext(layer, monkeypatch)
    x = torch.randn(6, 576)
    y = layer(x)
    assert ext.small_m_max(0) == 16 and ext.small_m_max() == 0
    try:
        assert torch.equal(layer(x), y)  # oneDNN inside the op
    finally:
        ext.small_m_max(16)
    assert torch.equal(plain(x), y)  # QUASAR_NO_EXT: the pure-PyTorch path
    assert ext.small_m_max(999) == 16 and ext.small_m_max() == 128  # capped at 128
    ext.small_m_max(16)


@pytest.mark.parametrize("act_bits", [8, 15])
def test_small_m_kernel_takes_a_prefill_chunk_bitwise(small_m, act_bits: int) -> None:
    """The fused op's GEMMs multiply all rows of a step (up to 128) in one small-M call,
    each weight tile read once and every row passed over it from L2: the same bits as
    oneDNN and the reference, and each row's result is its own whatever the row count."""
    from quasar.kernels import ext

    for k, n in ((577, 193), (1536, 130)):
        _, layer = _layer(k, n, bias=True)
        layer.act_bits = act_bits
        assert layer.packing().packed.tiles is not None  # the small-M kernel's operand
        ref = Int8Linear.from_float(nn.Linear(k, n), backend="reference", act_bits=act_bits)
        ref.load_state_dict(layer.state_dict())
        x = _hard_rows(128, k, torch.float32)
        onednn = ext.small_m_max(0)
        try:
            want = layer(x)  # oneDNN inside the op
        finally:
            ext.small_m_max(onednn)
        assert torch.equal(want, ref(x)), (k, act_bits)
        ext.small_m_max(128)
        try:
            for m in (17, 40, 97, 128):
                assert torch.equal(layer(x[:m]), want[:m]), (k, act_bits, m)
            assert torch.equal(layer(x[-23:]), want[-23:])
        finally:
            ext.small_m_max(16)


# ---------------------------------------------------------------- 15-bit activations
@pytest.mark.parametrize("k,n", [(2, 3), (64, 48), (577, 193), (1536, 576)])
def test_act15_paths_agree_bitwise(ext_op, monkeypatch, k: int, n: int) -> None:
    """act_bits=15 (q = 128 * hi + lo, two int8 GEMMs): the C++ op (small-M split kernel
    up to 16 rows, oneDNN twice beyond), the PyTorch path and the reference agree bit for
    bit, and a row's result does not depend on the rows computed with it."""
    _, layer = _layer(k, n, bias=True)
    layer.act_bits = 15
    plain = _without_ext(layer, monkeypatch)
    plain.act_bits = 15
    ref = Int8Linear.from_float(nn.Linear(k, n), backend="reference", act_bits=15)
    ref.load_state_dict(layer.state_dict())
    for m in (1, 2, 5, 9, 16, 17):
        x = _hard_rows(m, k, torch.float32)
        y = layer(x)
        assert torch.equal(y, plain(x)), m
        assert torch.equal(y, ref(x)), m
        assert torch.equal(layer(x[-1:]), y[-1:]), m


def test_act15_is_much_closer_to_the_float_layer() -> None:
    """With 15-bit activations nearly all the error left is the int8 weights'."""
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(1536, 576)
    outliers = 1 + 30 * (torch.rand(1536, generator=gen) < 0.01)  # a few large channels
    x = torch.randn(32, 1536, generator=gen) * outliers
    q8 = Int8Linear.from_float(lin, backend="reference")
    q15 = Int8Linear.from_float(lin, backend="reference", act_bits=15)
    with torch.no_grad():
        want = lin(x)
        weights_only = torch.nn.functional.linear(x, q8.dequantized_weight(), lin.bias)
        err8, err15 = (q8(x) - want).norm(), (q15(x) - want).norm()
        err_w = (weights_only - want).norm()
    assert err15 < 0.5 * err8
    assert abs(err15 - err_w) < 0.05 * err_w
    with pytest.raises(QuasarError, match="act_bits"):
        Int8Linear(4, 4, act_bits=16)


def test_tile_layout_matches_its_definition(small_m) -> None:
    """pack_tiles against the layout written out index by index (gemm_w8a8/int8_gemm.h), then the
    footer whose first byte says the weights are symmetric (no -128)."""
    from quasar.kernels import ext

    gen = torch.Generator().manual_seed(3)
    for n, k, symmetric in ((1, 1, True), (17, 5, False), (64, 8, True), (100, 131, False), (130, 4, True)):
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        if not symmetric:
            w[n // 2, k // 2] = -128
        k4 = -(-k // 64) * 64  # columns padded to 64 (an AMX tile's row)
        want = torch.zeros(-(-n // 16) * 16 * k4 + 64, dtype=torch.int8)
        want[-64] = int(symmetric)
        for r in range(n):
            tile, i = divmod(r, 64)
            nv = (min(64, n - 64 * tile) + 15) // 16  # the tile's vectors of 16 rows
            for c in range(k):
                want[64 * tile * k4 + (c // 4) * nv * 64 + (i // 16) * 64 + (i % 16) * 4 + c % 4] = w[r, c]
        assert torch.equal(ext.pack_tiles(w), want), (n, k)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT) is Linux's")
def test_released_weight_pages_leave_memory_and_lose_nothing(ext_op, tmp_path) -> None:
    """A layer packed from a memory-mapped checkpoint drops the row-major copy's pages from
    the resident set; the weight still reads back intact (from the file)."""
    from quasar.models.safetensors_mmap import mmap_safetensors
    from quasar.kernels import ext
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(4)
    w = torch.randint(-128, 128, (8192, 8192), generator=gen, dtype=torch.int8)  # 64 MiB
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    mapped = mmap_safetensors(tmp_path / "w.safetensors")["w"]
    assert torch.equal(mapped, w)  # every page touched: resident
    before = _rss_bytes()
    if not ext.release_pages(mapped):
        pytest.skip("this kernel does not take MADV_PAGEOUT")
    assert _rss_bytes() < before - 32 * 2**20
    assert torch.equal(mapped, w)
    anon = w.clone()  # anonymous memory: kept (or swapped), never lost
    ext.release_pages(anon)
    assert torch.equal(anon, w)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT) is Linux's")
def test_packing_hands_back_each_tiles_source_rows(ext_op, tmp_path) -> None:
    """pack_tiles(release_source=True) gives the same tiles, and a memory-mapped weight is
    never resident twice: its pages leave while the tiles are written (an 8B model's head
    would otherwise top the decode peak)."""
    from quasar.models.safetensors_mmap import mmap_safetensors
    from quasar.kernels import ext
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (8192, 8192), generator=gen, dtype=torch.int8)  # 64 MiB
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    mapped = mmap_safetensors(tmp_path / "w.safetensors")["w"]
    if not ext.release_pages(mapped):
        pytest.skip("this kernel does not take MADV_PAGEOUT")
    assert torch.equal(mapped, w)  # every page read back: resident
    before = _rss_bytes()
    tiles = ext.pack_tiles(mapped, release_source=True)
    assert _rss_bytes() < before + 32 * 2**20  # 64 MiB of tiles, 64 MiB of source handed back
    assert torch.equal(tiles, ext.pack_tiles(w)) and torch.equal(mapped, w)


# ---------------------------------------------------------------- AMX (Sapphire Rapids and later)
@pytest.fixture
def amx(small_m):
    """The op with its AMX path available (skipped on CPUs without AMX-INT8); the AMX row
    threshold and the small-M limit are restored afterwards."""
    from quasar.kernels import ext

    if not ext.amx_supported():
        pytest.skip("CPU without AMX-INT8 (or Linux refuses the tile state)")
    old_min, old_max = ext.amx_min_rows(), ext.small_m_max(128)
    yield small_m
    ext.amx_min_rows(old_min)
    ext.small_m_max(old_max)


@pytest.mark.parametrize("act_bits", [8, 15])
def test_amx_sums_are_bitwise_the_vnni_kernels(amx, act_bits: int) -> None:
    """Tile multiplies and vpdpbusd compute the same exact int32 sums: every row count
    (one and several 16-row blocks, partial last blocks), K not a multiple of 64 (padded),
    N with partial tiles and vectors, 8- and 15-bit activations give the same bits."""
    from quasar.kernels import ext

    gen = torch.Generator().manual_seed(act_bits)
    for k, n in ((1, 1), (5, 17), (64, 48), (131, 100), (577, 193), (1536, 130)):
        w = _int8(gen, n, k)
        ws = torch.rand(n, 1, generator=gen) / 100
        bias = torch.randn(n, generator=gen)
        comp = w.sum(dim=1, dtype=torch.int32).mul_(128)
        tiles = ext.pack_tiles(w)
        for m in (1, 2, 3, 15, 16, 17, 33, 64, 100, 128):
            x = _hard_rows(m, k, torch.float32)
            ext.amx_min_rows(0)
            want = amx(x, w, ws, bias, comp, True, True, tiles, act_bits)
            ext.amx_min_rows(1)
            got = amx(x, w, ws, bias, comp, True, True, tiles, act_bits)
            assert torch.equal(got, want), (k, n, m, act_bits)
        if k > 1:  # and oneDNN's
            ext.small_m_max(0)
            assert torch.equal(amx(x, w, ws, bias, comp, True, True, tiles, act_bits), got)
            ext.small_m_max(128)


def test_kernel_path_switch(ext_op) -> None:
    """QUASAR_ISA caps the kernel path in a fresh process (the highest path at or below it
    that the CPU runs; the paths below AVX512 widen a bf16 KV cache), a bad value is a one-line error
    naming the choices, and the ops say which path runs."""
    import subprocess

    from quasar.kernels import ext

    runs = [p for p in ext.KERNEL_PATHS if ext.cpu_runs(p)]
    assert runs[0] == "portable"
    cap = ext.KERNEL_PATHS.index(ext.requested_kernel_path() or "amx")  # this process's own QUASAR_ISA
    best = [p for p in runs if ext.KERNEL_PATHS.index(p) <= cap][-1]
    assert ext.kernel_path() == best or (best == "amx" and ext.amx_min_rows() == 0)
    code = "from quasar.kernels import ext; ext.int8_linear_op(); print(ext.kernel_path(), ext.bf16_kv_supported())"
    for want in runs:
        env = {**os.environ, "QUASAR_ISA": want}
        env.pop("QUASAR_NO_AMX", None)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        path, bf16 = out.stdout.split()
        assert path == want, out.stdout
        if want in ("portable", "avx2", "avx-vnni"):
            assert bf16 == "True"  # stored bf16, widened to float32 by the 8-float kernels
    bad = subprocess.run([sys.executable, "-m", "quasar", "generate", "--prompt", "hi"],
                         env={**os.environ, "QUASAR_ISA": "sse9"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "QUASAR_ISA must be one of portable, avx2, avx-vnni, avx512-vnni, amx" in bad.stderr
    with pytest.raises(ValueError):
        with ext.forced_kernel_path("sse9"):
            pass


def test_amx_is_on_by_default_and_can_be_turned_off(amx) -> None:
    """Where the CPU has AMX, steps of 2+ rows use it and Int8Linear sends it up to 128 rows;
    QUASAR_NO_AMX=1 in a fresh process keeps the VNNI kernel and its 16-row limit."""
    import subprocess

    code = ("from quasar.kernels import ext; ext.int8_linear_op(); "
            "print(ext.amx_supported(), ext.amx_min_rows(), ext.small_m_max())")
    env = {k: v for k, v in os.environ.items() if k not in ("QUASAR_NO_AMX", "QUASAR_ISA")}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], env={**env, "QUASAR_NO_AMX": "1"},
                         capture_output=True, text=True, check=True)
    assert on.stdout.split() == ["True", "2", "128"]
    assert off.stdout.split() == ["False", "0", "16"]


# ---------------------------------------------------------------- argmax / top-k of logits rows
def test_row_argmax_topk_matches_torch(ext_op) -> None:
    """The one-pass select op picks torch.argmax's token in every row (first of equal
    maxima, -0.0 == 0.0, a NaN wins) and the same top-k values as torch.topk."""
    from quasar.kernels import ext

    op = ext.row_argmax_topk_op()
    gen = torch.Generator().manual_seed(0)
    for trial in range(120):
        rows, vocab = int(torch.randint(1, 20, (1,), generator=gen)), int(torch.randint(1, 3000, (1,), generator=gen))
        x = torch.randn(rows, vocab, generator=gen)
        if trial % 3 == 0:
            x = torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # many ties
        if trial % 5 == 0:
            x[0, int(torch.randint(0, vocab, (1,), generator=gen))] = float("nan")
        if trial % 7 == 0:
            x.zero_()
            x[:, 1::2] = -0.0
        k = min(vocab, 8)
        best, top = op(x, k)
        assert torch.equal(best, x.argmax(dim=-1)), trial
        finite = torch.nan_to_num(x, nan=-float("inf"))
        assert torch.equal(finite.gather(1, top), finite.topk(k, dim=-1).values), trial
    best, top = op(torch.randn(3, 50), 0)
    assert best.shape == (3,) and top.shape == (3, 0)
    with pytest.raises(RuntimeError, match="k must be"):
        op(torch.randn(2, 5), 6)
