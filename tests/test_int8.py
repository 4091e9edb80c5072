"""Int8 GEMM backends are exact, and Int8Linear keeps a token's result batch-independent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quasar.errors import QuasarError
from quasar.quant import kernels
from quasar.quant.int8 import (
    Int8Linear,
    quantize_activation,
    quantize_weight,
    set_backend,
)

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
    assert "s8" in kernels.exact_cpu_variants()
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
