"""The W8A8 numbers themselves: how weights and activations are quantized, the exact
integer product, and the epilogue back to float. A leaf module (torch only), shared by the
layer (``int8``), the GEMM backends (``kernels``) and the C++ ops' self-check (``ext``).

Weights: symmetric int8 per output channel. Activations: symmetric per token, computed at
run time, 8 bits (or 15, see ``split_mm``). The int32 product is exact and the quantizer and
epilogue are elementwise or per-row in one fixed float32 order, so a token's output is
bitwise the same whether it is computed alone or with other tokens, on every backend of
one device (ARCHITECTURE.md, "Row invariance").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from quasar.errors import QuasarError

# |acc| <= 128 * 128 * K must fit in int32.
MAX_IN_FEATURES = (2**31 - 1) // (128 * 128)
# Rows whose max is below 127 * _MIN_SCALE get scale _MIN_SCALE instead of dividing by ~0.
_MIN_SCALE = 1e-12
_BLOCK_ELEMENTS = 1 << 24  # quantize_weight's rows a block: 64 MB of float32


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output channel: scale = max|w_row| / 127 (1.0 for zero rows).

    Rows are independent, so they are rounded a block at a time: a vocabulary-sized head
    (151936 x 4096 at 8B) needs no float32 copies of itself, only of one block."""
    if w.dim() != 2 or not w.is_floating_point():
        raise QuasarError(f"quantize_weight expects a 2-D float tensor, got {w.dim()}-D {w.dtype}")
    rows = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=w.device)
    step = max(1, _BLOCK_ELEMENTS // max(1, w.shape[1]))
    for r in range(0, rows, step):
        w32 = w[r:r + step].detach().float()
        amax = w32.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q[r:r + step] = torch.round(w32 / s).clamp_(-127, 127).to(torch.int8)
        scale[r:r + step] = s
    return q, scale


ACT_BITS = (8, 15)  # activation precisions an Int8Linear runs (see the module doc)


def quantize_activation(x: Tensor, bits: int = 8) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric per-token quantization (last dim) to ``bits`` bits: returns
    (int8, or int16 for 15 bits, like x; float32 scales [..., 1]).

    Only per-row reductions and correctly rounded elementwise ops, so a row's result is
    independent of the other rows. |x / scale| <= limit up to one rounding, so no clamp.
    """
    limit = float(2 ** (bits - 1) - 1)  # 127 or 16383
    xf = x if x.dtype == torch.float32 else x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min_(limit * _MIN_SCALE).div_(limit)
    q = torch.div(xf, scale).round_().to(torch.int8 if bits == 8 else torch.int16)
    return q, scale


def split_mm(mm: Any, packed: Any, q: Tensor) -> Tensor:
    """The exact product of 15-bit activations q (int16) with an int8 weight as two int8
    GEMMs: q = 128 * hi + lo, hi in [-128, 127], lo in [0, 127]; int64 result."""
    hi = torch.bitwise_right_shift(q, 7).to(torch.int8)
    lo = torch.bitwise_and(q, 127).to(torch.int8)
    return mm(hi, packed).to(torch.int64).mul_(128).add_(mm(lo, packed))


def reference_mm(qx: Tensor, packed: tuple) -> Tensor:
    """qx @ W.T as int32 for ``packed = (W,)``, exact on any device: integer sums stay below
    2**53, so float64 never rounds."""
    (weight,) = packed
    return (qx.double() @ weight.double().t()).to(torch.int32)


def scale_output(
    acc: Tensor, sx: Tensor, weight_scale: Tensor, bias: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """int32 (int64 for 15-bit activations) [M, N] -> contiguous ``dtype`` [M, N] as
    ``(float(acc) * s_w) * s_x + bias``.

    One fixed fp32 order on every backend and batch size keeps results bitwise equal.
    """
    if weight_scale.dtype != torch.float32:  # e.g. after module.half()
        weight_scale = weight_scale.float()
    y = torch.mul(acc, weight_scale.t())
    y.mul_(sx)
    if bias is not None:
        y.add_(bias)
    if y.dtype != dtype:
        y = y.to(dtype)
    return y if y.is_contiguous() else y.contiguous()
