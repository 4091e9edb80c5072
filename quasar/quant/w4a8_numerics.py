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

    y = (((0 + S_0 * s_0) + S_1 * s_1) + ... + S_{G-1} * s_{G-1}) * s_x + bias

in float32, groups in order, each product rounded before its add (no fused multiply-add),
so a token's output does not depend on the other tokens of the batch (row invariance) and
greedy speculative decoding equals greedy decoding of the same verifier.

Affine groups (``quantize_weight_w4_affine``): w = scale * q + offset with q in [0, 15], one
offset a group, the form of GGUF's 4-bit blocks (Q4_1, and Q4_K's 32-weight sub-blocks), so
a model that comes as a 4-bit GGUF keeps its own weights instead of being rounded a second
time (on the default model, weight-only: symmetric groups of 32 keep 73% top-1 agreement
with the float model, affine groups of 32 all of it; the float model is the file's own
weights dequantized). The product stays exact: the group's sum is scale * (sum of q_w * q_x) + offset *
(sum of q_x), two integer sums, the second shared by every output row; the epilogue adds
S_g * s_g, then X_g * o_g, group by group.

Storage: two weights a byte (``pack_int4``), column 2j in the low nibble and 2j + 1 in the
high one, symmetric q as q + 8 in [1, 15], affine q as is; a row of odd K ends in a
half-used byte.
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
    w32 = _grouped(w, group)
    amax = w32.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))
    q = torch.round(w32 / scale).clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)
    return _ungrouped(q, w.shape[1]), scale.squeeze(2)


def quantize_weight_w4_affine(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Affine int4 per group (min to max in 15 steps): returns q (int8 [N, K] in [0, 15]),
    float32 scales and offsets [N, n_groups(K, group)]; w ~ scale * q + offset. A padded
    last group takes its range from its real columns only."""
    w32 = _grouped(w, group)
    k = w.shape[1]
    real = (torch.arange(w32.shape[1] * group) < k).view(1, -1, group)
    lo = torch.where(real, w32, torch.inf).amin(dim=2, keepdim=True)
    hi = torch.where(real, w32, -torch.inf).amax(dim=2, keepdim=True)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
    q = torch.round((w32 - lo) / scale).clamp_(0, 15).to(torch.int8)
    return _ungrouped(q, k), scale.squeeze(2), lo.squeeze(2)


def _grouped(w: Tensor, group: int) -> Tensor:
    """w [N, K] as float32 [N, G, group], the last group padded with zeros."""
    _check_group(group)
    if w.dim() != 2 or not w.is_floating_point():
        raise QuasarError(f"quantizing to int4 needs a 2-D float tensor, got {w.dim()}-D {w.dtype}")
    n, k = w.shape
    g = n_groups(k, group)
    return torch.nn.functional.pad(w.detach().float(), (0, g * group - k)).view(n, g, group)


def _ungrouped(q: Tensor, k: int) -> Tensor:
    return q.reshape(q.shape[0], -1)[:, :k].contiguous()


def dequantize_w4(q: Tensor, scales: Tensor, group: int, offsets: Tensor | None = None) -> Tensor:
    """float32 weights q * scale (+ offset for affine groups)."""
    _check_group(group)
    k = q.shape[1]
    w = q.float() * scales.repeat_interleave(group, dim=1)[:, :k]
    return w if offsets is None else w + offsets.repeat_interleave(group, dim=1)[:, :k]


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


def activation_group_sums(qx: Tensor, group: int) -> Tensor:
    """Each row's sum of q_x per group: int32 [M, G] (affine groups' offset term)."""
    _check_group(group)
    m, k = qx.shape
    g = n_groups(k, group)
    return torch.nn.functional.pad(qx.long(), (0, g * group - k)).view(m, g, group).sum(2).to(torch.int32)


def scale_output_w4(sums: Tensor, sx: Tensor, scales: Tensor, bias: Tensor | None,
                    dtype: torch.dtype = torch.float32, offsets: Tensor | None = None,
                    x_sums: Tensor | None = None) -> Tensor:
    """int32 group sums [M, N, G] -> ``dtype`` [M, N] in the module docstring's order;
    affine groups also take their offsets [N, G] and the activations' group sums [M, G]."""
    if (offsets is None) != (x_sums is None):
        raise QuasarError("scale_output_w4: affine groups need both offsets and x_sums")
    s = scales.float()
    acc = torch.zeros(sums.shape[:2])
    for g in range(sums.shape[2]):
        acc = acc + sums[:, :, g].float() * s[:, g]
        if offsets is not None:
            acc = acc + x_sums[:, g:g + 1].float() * offsets[:, g].float()
    y = acc * sx.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype).contiguous()


def reference_linear_w4a8(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None, group: int,
                          offsets: Tensor | None = None) -> Tensor:
    """The W4A8 layer on x [M, K] float: per-token int8 activations (as W8A8's), exact group
    sums, the fixed-order epilogue. What every W4A8 kernel must reproduce bit for bit."""
    from quasar.quant.numerics import quantize_activation

    qx, sx = quantize_activation(x.float())
    x_sums = None if offsets is None else activation_group_sums(qx, group)
    return scale_output_w4(group_sums(qx, q, group), sx, scales, bias, offsets=offsets, x_sums=x_sums)


def pack_int4(q: Tensor, affine: bool = False) -> Tensor:
    """int4 values (int8 [N, K] in [-7, 7], affine: in [0, 15]) -> uint8 [N, ceil(K / 2)],
    two a byte, symmetric ones as q + 8 (see the module docstring); the unused high nibble
    of an odd row's last byte is 0."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise QuasarError(f"pack_int4 expects a 2-D int8 tensor, got {q.dim()}-D {q.dtype}")
    low, high = (0, 15) if affine else (-INT4_MAX, INT4_MAX)
    if q.numel() and (int(q.min()) < low or int(q.max()) > high):
        raise QuasarError(f"pack_int4: values must lie in [{low}, {high}]")
    n, k = q.shape
    u = (q.to(torch.int16) + (0 if affine else 8)).to(torch.uint8)
    if k % 2:
        u = torch.cat([u, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor, in_features: int, affine: bool = False) -> Tensor:
    """The inverse of ``pack_int4``: int8 [N, in_features]."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] != -(-in_features // 2):
        raise QuasarError(f"unpack_int4: expected uint8 [N, {-(-in_features // 2)}], "
                          f"got {packed.dtype} {tuple(packed.shape)}")
    bias = 0 if affine else 8
    lo = (packed & 15).to(torch.int8) - bias
    hi = (packed >> 4).to(torch.int8) - bias
    return torch.stack([lo, hi], dim=2).view(packed.shape[0], -1)[:, :in_features].contiguous()


def w4_weight_bytes(out_features: int, in_features: int, group: int, scale_bytes: int = 4,
                    affine: bool = False) -> int:
    """Bytes a step reads for one W4A8 weight: the nibbles, the group scales (and offsets)."""
    per_group = scale_bytes * (2 if affine else 1)
    return out_features * (-(-in_features // 2) + n_groups(in_features, group) * per_group)
