"""The W4A8 numbers (issue #34): int4 weights in groups along the input dimension, int8
activations per token as in W8A8, an exact int32 sum per group, and the groups added in
float in one fixed order. A leaf module (torch only), the reference every W4A8 kernel must
match bit for bit, as ``numerics`` is for W8A8.

Weights: symmetric int4 per (output row, group of ``group`` input columns), scale =
max|w| / 7 over the group; the last group of a row may be shorter when K is not a multiple
of ``group``. The levels are [-7, 7]: -8 is left unused, as W8A8 leaves -128, so a weight
can be negated (the AVX2 kernels move an activation's sign onto it) and nothing saturates.

Arithmetic: a group's sum of q_w * q_x is at most 7 * 127 * group in magnitude, exact in
int32 and, below 2**24, in float32 too. The epilogue is

    y = ((((S_0 * s_0) + S_1 * s_1) + ...) + S_{G-1} * s_{G-1}) * s_x + bias

in float32, groups in order, each product rounded before its add (no fused multiply-add),
so a token's output does not depend on the other tokens of the batch (row invariance) and
greedy speculative decoding equals greedy decoding of the same verifier.

Storage: two weights a byte (``pack_int4``), column 2j in the low nibble and 2j + 1 in the
high one, each as q + 8 in [1, 15]; a row of odd K ends in a half-used byte.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quasar.errors import QuasarError

GROUP_SIZES = (32, 64, 128)  # the candidates issue #34 names; chosen by measuring
INT4_MAX = 7


def n_groups(in_features: int, group: int) -> int:
    """Groups of a row of ``in_features`` weights (the last may be shorter)."""
    return -(-in_features // group)


def _check_group(group: int) -> None:
    if not isinstance(group, int) or group < 1:
        raise QuasarError(f"the W4A8 group size must be a positive integer, got {group!r}")


def quantize_weight_w4(w: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Symmetric int4 per group: returns q (int8 [N, K], values in [-7, 7]) and float32
    scales [N, n_groups(K, group)] (1.0 for all-zero groups)."""
    _check_group(group)
    if w.dim() != 2 or not w.is_floating_point():
        raise QuasarError(f"quantize_weight_w4 expects a 2-D float tensor, got {w.dim()}-D {w.dtype}")
    n, k = w.shape
    g = n_groups(k, group)
    w32 = torch.nn.functional.pad(w.detach().float(), (0, g * group - k)).view(n, g, group)
    amax = w32.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    q = torch.round(w32 / scale).clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)
    return q.view(n, g * group)[:, :k].contiguous(), scale.view(n, g)


def dequantize_w4(q: Tensor, scales: Tensor, group: int) -> Tensor:
    """float32 weights q * scale (what the quantized layer multiplies by, before rounding)."""
    _check_group(group)
    n, k = q.shape
    return q.float() * scales.repeat_interleave(group, dim=1)[:, :k]


def group_sums(qx: Tensor, q: Tensor, group: int) -> Tensor:
    """The exact per-group sums of qx [M, K] (int8) times q [N, K] (int4 values as int8):
    int32 [M, N, G]. float64 products of integers this small never round."""
    _check_group(group)
    m, k = qx.shape
    n, k_w = q.shape
    if k != k_w:
        raise QuasarError(f"group_sums: activations have {k} columns, weights {k_w}")
    g = n_groups(k, group)
    pad = g * group - k
    x = torch.nn.functional.pad(qx.double(), (0, pad)).view(m, g, group).transpose(0, 1)  # [G, M, group]
    wq = torch.nn.functional.pad(q.double(), (0, pad)).view(n, g, group).permute(1, 2, 0)  # [G, group, N]
    return torch.bmm(x, wq).permute(1, 2, 0).to(torch.int32).contiguous()


def scale_output_w4(sums: Tensor, sx: Tensor, scales: Tensor, bias: Tensor | None,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """int32 group sums [M, N, G] -> ``dtype`` [M, N] in the module docstring's order."""
    s = scales.float()
    acc = sums[:, :, 0].float() * s[:, 0]
    for g in range(1, sums.shape[2]):
        acc = acc + sums[:, :, g].float() * s[:, g]
    y = acc * sx.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype).contiguous()


def reference_linear_w4a8(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None, group: int) -> Tensor:
    """The W4A8 layer on x [M, K] float: per-token int8 activations (as W8A8's), exact group
    sums, the fixed-order epilogue. What every W4A8 kernel must reproduce bit for bit."""
    from quasar.quant.numerics import quantize_activation

    qx, sx = quantize_activation(x.float())
    return scale_output_w4(group_sums(qx, q, group), sx, scales, bias)


def pack_int4(q: Tensor) -> Tensor:
    """int4 values (int8 [N, K] in [-7, 7]) -> uint8 [N, ceil(K / 2)], two a byte (see the
    module docstring); the unused high nibble of an odd row's last byte is 0."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise QuasarError(f"pack_int4 expects a 2-D int8 tensor, got {q.dim()}-D {q.dtype}")
    if q.numel() and int(q.abs().max()) > INT4_MAX:
        raise QuasarError(f"pack_int4: values must lie in [-{INT4_MAX}, {INT4_MAX}]")
    n, k = q.shape
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if k % 2:
        u = torch.cat([u, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor, in_features: int) -> Tensor:
    """The inverse of ``pack_int4``: int8 [N, in_features]."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] != -(-in_features // 2):
        raise QuasarError(f"unpack_int4: expected uint8 [N, {-(-in_features // 2)}], "
                          f"got {packed.dtype} {tuple(packed.shape)}")
    lo = (packed & 15).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=2).view(packed.shape[0], -1)[:, :in_features].contiguous()


def w4_weight_bytes(out_features: int, in_features: int, group: int, scale_bytes: int = 4) -> int:
    """Bytes a step reads for one W4A8 weight: the nibbles and the group scales."""
    return out_features * (-(-in_features // 2) + n_groups(in_features, group) * scale_bytes)
