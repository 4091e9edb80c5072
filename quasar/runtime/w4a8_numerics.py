"""The W4A8 numbers (issue #34): 4-bit weights in affine groups along the input dimension,
int8 activations per token and group, an exact integer sum per group, and the groups added
in float in one fixed order. A leaf module (torch only), the reference every W4A8 kernel
must match bit for bit, as ``numerics`` is for W8A8.

Weights: one form, affine per (output row, group of ``group`` input columns): w = scale * q
+ offset with q in [0, 15]. It is the form of GGUF's 4-bit blocks (Q4_0 is offset = -8 d,
Q4_1 and Q4_K's sub-blocks carry their own), so a model that comes as a 4-bit GGUF keeps its
own weights instead of being rounded a second time (rounding them again to symmetric groups
loses much of the top-1 agreement with the float model that the file's own groups keep). A
symmetric quantizer's q in [-7, 7] is the affine q + 8 with offset -8 * scale
(``symmetric_as_affine``; exact: a power of two times the scale). One form means one kernel
per ISA, and unsigned nibbles are the u8 operand of vpdpbusd and vpmaddubsw as they are.

Activations: int8 per token *and group* (the weights' groups), scale amax / 127 over the
group, as llama.cpp's Q8 blocks. Per token alone (W8A8's rule) agrees clearly less often
with the float model's top-1 (scripts/tools/w4_fidelity.py with the file's own 4-bit groups): a
4-bit group's error is already spent, so the activations must not add one per token on top.

Arithmetic: per row m, column n, group g two integer sums, S = sum of q_w * q_x (at most
15 * 127 * group) and X = sum of q_x (the offset's term, shared by every column), exact in
int32 and, below 2**24, in float32. The epilogue, in float32, each product rounded before
its add (no fused multiply-add), groups in order:

    xs_g = float(X_g) * sx_g                      (once per row and group)
    acc  = 0
    acc  = (acc + (float(S_g) * sx_g) * scale_g) + xs_g * offset_g      for g = 0, 1, ...
    y    = acc + bias

so a token's output does not depend on the other tokens of the batch (row invariance) and
greedy speculative decoding equals greedy decoding of the same verifier.

Storage (``pack_int4``): two weights a byte, column 2j in the low nibble and 2j + 1 in the
high one; a row of odd K ends in a half-used byte. Scales and offsets are float16 numbers
(``SCALE_DTYPE``, ``as_group_params``): a group of 32 then costs 4 + 1 bits a weight, not
4 + 2, and the step streams that much less. GGUF's Q4_0 and Q4_1 store theirs as float16
already; Q4_K's (a float16 times a 6-bit integer) keep their own two levels in the Q4_K form
(``Q4K_FORM``: float32 products, exact, at 4.5 bits a weight); a float model's are rounded
once, and the quantizers below round the weights against the float16 scale, not the wider one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from quasar.errors import QuasarError
from quasar.runtime.w8a8_numerics import quantize_activation

GROUP_SIZES = (32, 64, 128)  # the candidates issue #34 names; chosen by measuring
# The Q4_K form: groups of 32 whose scales and offsets are a Q4_K file's own, d * c and m * o
# (float16 d, m per superblock of Q4K_SUPER groups, 6-bit codes c, o per group; exact products
# in float32), streamed as they are stored (4.5 bits a weight). The kernels' form code.
Q4K_FORM = 32 | 256
Q4K_SUPER = 8
# The Q6_K form: a Q6_K file's 6-bit weights as stored, w = d * s * (q - 32), q in [0, 63], an
# int8 s per 16 columns and a float16 d per 256 (6.5625 bits a weight): reference_linear_q6k.
Q6K_FORM = 32 | 512
Q6K_SUB = 16
W4A8_GROUP = 32  # the verifier's: GGUF's 4-bit blocks hold groups of 32, float models use the same
INT4_MAX = 7
SCALE_DTYPE = torch.float16  # the stored scales and offsets; the epilogue widens them exactly
# The smallest normal float16: a quantizer's scale floor, so a group of tiny (or zero)
# weights never gets a subnormal or zero scale.
MIN_SCALE = 2.0 ** -14


def as_group_params(t: Tensor, what: str = "scales") -> Tensor:
    """Scales or offsets as the stored float16 (round to nearest); a value float16 cannot
    hold (|v| > 65504, NaN) is an error, not an infinity in the model."""
    h = t.detach().to(SCALE_DTYPE).contiguous()
    if not bool(torch.isfinite(h).all()):
        raise QuasarError(f"W4A8 {what} must be finite float16 numbers (|v| <= 65504); "
                          f"got one outside after rounding (largest |v|: {float(t.detach().abs().max()):.4g})")
    return h


def q4k_group_params(scale_codes: Tensor, offset_codes: Tensor, super_scales: Tensor,
                     super_offsets: Tensor) -> tuple[Tensor, Tensor]:
    """The Q4_K form's float32 scales and offsets [N, G]: d * c and m * o, each product exact
    (a float16's 11 significant bits times a 6-bit code), as every kernel computes them."""
    def product(codes: Tensor, supers: Tensor) -> Tensor:
        return supers.float().repeat_interleave(Q4K_SUPER, dim=1) * codes.float()
    return product(scale_codes, super_scales), product(offset_codes, super_offsets)


def n_groups(in_features: int, group: int) -> int:
    """Groups of a row of ``in_features`` weights (the last may be shorter)."""
    return -(-in_features // group)


def _check_group(group: int) -> None:
    if not isinstance(group, int) or group < 1:
        raise QuasarError(f"the W4A8 group size must be a positive integer, got {group!r}")


def quantize_weight_w4(w: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Symmetric int4 per group: returns q (int8 [N, K], values in [-7, 7]) and float16
    scales [N, n_groups(K, group)] (amax / 7, at least MIN_SCALE; q rounds against the
    float16 scale)."""
    w32 = _grouped(w, group)
    amax = w32.abs().amax(dim=2, keepdim=True)
    scale = as_group_params((amax / INT4_MAX).clamp_(min=MIN_SCALE))
    q = torch.round(w32 / scale.float()).clamp_(-INT4_MAX, INT4_MAX).to(torch.int8)
    return _ungrouped(q, w.shape[1]), scale.squeeze(2)


def quantize_weight_w4_affine(w: Tensor, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Affine int4 per group (min to max in 15 steps): returns q (int8 [N, K] in [0, 15]),
    float16 scales and offsets [N, n_groups(K, group)]; w ~ scale * q + offset. A padded
    last group takes its range from its real columns only."""
    w32 = _grouped(w, group)
    k = w.shape[1]
    real = (torch.arange(w32.shape[1] * group) < k).view(1, -1, group)
    lo = as_group_params(torch.where(real, w32, torch.inf).amin(dim=2, keepdim=True), "offsets")
    hi = torch.where(real, w32, -torch.inf).amax(dim=2, keepdim=True)
    scale = as_group_params(((hi - lo.float()) / 15).clamp_(min=MIN_SCALE))
    q = torch.round((w32 - lo.float()) / scale.float()).clamp_(0, 15).to(torch.int8)
    return _ungrouped(q, k), scale.squeeze(2), lo.squeeze(2)


def fit_weight_w4_affine(w: Tensor, group: int, steps: int = 10) -> tuple[Tensor, Tensor, Tensor]:
    """Affine int4 per group fitted to the weights, as llama.cpp fits its Q4_K blocks: q, float16
    scales and offsets as ``quantize_weight_w4_affine`` returns them, chosen per group to make
    the weighted squared error sum(c * (w - scale * q - offset)^2) small, where c = the group's
    RMS + |w| (large weights count more). For each of `steps` + 1 grids of 14 to 16 steps over
    the group's range, q is rounded and (scale, offset) is the weighted least-squares line
    through (q, w), whose residual is known from the sums without another pass; the grid with
    the least residual wins. Its line is rounded to float16 and q rounded again against it;
    where ``quantize_weight_w4_affine``'s min-max grid does better after that rounding (weights
    already on a 4-bit grid, which it gives back as they are), the group keeps the min-max grid.

    What it is for: a tensor a 4-bit GGUF keeps wider (Q4_K_M's Q6_K value and down
    projections) re-rounded to 4 bits: it gives a lower KL than min-max rounding, about that of
    a costlier search that scores each grid, and below llama.cpp's own Q4_K_M file. More grids
    than the default 11 lower the weighted error only slightly for their time
    (docs/bench/HISTORY.md has the figures)."""
    w32 = _grouped(w, group)
    k = w.shape[1]
    real = (torch.arange(w32.shape[1] * group) < k).view(1, -1, group)
    lo = torch.where(real, w32, torch.inf).amin(dim=2)
    span = (torch.where(real, w32, -torch.inf).amax(dim=2) - lo).clamp_(min=1e-30)
    rms = (w32.square().sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True)).sqrt_()
    c = torch.where(real, rms + w32.abs(), 0.0)
    cw = c * w32
    sc, sx, sxx = c.sum(2).double(), cw.sum(2).double(), (cw * w32).sum(2).double()
    unit = (w32 - lo[..., None]) / span[..., None]  # the range as [0, 1]
    best = torch.full_like(sc, torch.inf)
    scale, offset = (span / 15).double(), lo.double()
    for levels in (14.0 + 2.0 * i / steps for i in range(steps + 1)):
        q = torch.round(unit * levels).clamp_(0, 15)
        cq = c * q
        sq, sqq, sqx = cq.sum(2).double(), (cq * q).sum(2).double(), (cq * w32).sum(2).double()
        det = sc * sqq - sq * sq
        safe = torch.where(det > 0, det, 1.0)
        s = (sc * sqx - sq * sx) / safe
        o = (sqq * sx - sq * sqx) / safe
        residual = sxx - s * sqx - o * sx  # of the weighted least-squares line, before rounding
        better = (det > 0) & (s > 0) & (residual < best)
        best = torch.where(better, residual, best)
        scale, offset = torch.where(better, s, scale), torch.where(better, o, offset)

    def rounded(scale: Tensor, offset: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        scale = as_group_params(scale.float().clamp(min=MIN_SCALE)).float()
        offset = as_group_params(offset.float(), "offsets").float()
        q = torch.round((w32 - offset[..., None]) / scale[..., None]).clamp_(0, 15)
        return q, scale, offset, (c * (w32 - scale[..., None] * q - offset[..., None]).square()).sum(2)

    _, s0, o0 = quantize_weight_w4_affine(w, group)
    fit, minmax = rounded(scale, offset), rounded(s0, o0)
    keep = minmax[3] < fit[3]
    q = torch.where(keep[..., None], minmax[0], fit[0])
    scale, offset = torch.where(keep, minmax[1], fit[1]), torch.where(keep, minmax[2], fit[2])
    return _ungrouped(q.to(torch.int8), k), scale.to(SCALE_DTYPE), offset.to(SCALE_DTYPE)


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
    w = q.float() * scales.float().repeat_interleave(group, dim=1)[:, :k]
    return w if offsets is None else w + offsets.float().repeat_interleave(group, dim=1)[:, :k]


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


def symmetric_as_affine(q: Tensor, scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A symmetric quantizer's (q in [-7, 7], scales) in the one stored form: (q + 8 in
    [1, 15], scales, offsets = -8 * scales), the same weights exactly."""
    return (q + 8).to(torch.int8), scales, scales * -8.0


def quantize_activation_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric int8 quantization of x [M, K] per row and group of ``group``
    columns (the last group's range from its real columns): q int8 [M, K] and float32
    scales [M, n_groups(K, group)]. The same rounding as numerics.quantize_activation
    (scale amax / 127, floored; q = round(x / scale), ties to even) on each group."""
    _check_group(group)
    if x.dim() != 2:
        raise QuasarError(f"quantize_activation_groups expects a 2-D tensor, got {x.dim()}-D")
    m, k = x.shape
    g = n_groups(k, group)
    xf = torch.nn.functional.pad(x.float(), (0, g * group - k)).view(m, g, group)  # zeros never raise amax
    q, scale = quantize_activation(xf)
    return q.view(m, g * group)[:, :k].contiguous(), scale.view(m, g)


def scale_output_w4(sums: Tensor, x_sums: Tensor, sx: Tensor, scales: Tensor, offsets: Tensor,
                    bias: Tensor | None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The epilogue of the module docstring: int32 group sums [M, N, G], the activations'
    group sums x_sums [M, G] and scales sx [M, G], the weights' scales and offsets [N, G]
    -> ``dtype`` [M, N]."""
    s, o, sxf = scales.float(), offsets.float(), sx.float()
    xs = x_sums.float() * sxf
    acc = torch.zeros(sums.shape[:2])
    for g in range(sums.shape[2]):
        acc = acc + (sums[:, :, g].float() * sxf[:, g:g + 1]) * s[:, g]
        acc = acc + xs[:, g:g + 1] * o[:, g]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(dtype).contiguous()


def reference_linear_w4a8(x: Tensor, q: Tensor, scales: Tensor, offsets: Tensor, bias: Tensor | None,
                          group: int) -> Tensor:
    """The W4A8 layer on x [M, K] float with affine weights (q int8 [N, K] in [0, 15],
    scales and offsets [N, G]): int8 activations per row and group, exact group sums, the
    fixed-order epilogue. What every W4A8 kernel must reproduce bit for bit."""
    qx, sx = quantize_activation_groups(x, group)
    return scale_output_w4(group_sums(qx, q, group), activation_group_sums(qx, group), sx, scales, offsets, bias)


def reference_linear_q6k(x: Tensor, q: Tensor, sub_scales: Tensor, super_scales: Tensor,
                         bias: Tensor | None) -> Tensor:
    """The Q6_K form's numbers (float32 [M, N]) for x [M, K], q [N, K] in [0, 63], int8
    sub_scales [N, K / 16], float16 super_scales [N, K / 256]: activations int8 per row and
    group of 32 as above; per group the exact sums S_a, S_b of q * q_x over its two halves and
    X_a, X_b of q_x; T = s_a (S_a - 32 X_a) + s_b (S_b - 32 X_b) (exact, int32 in the kernels);
    acc = acc + (float32(T) * sx) * d group by group (float32(T) rounds to nearest even)."""
    m, k = x.shape
    n = q.shape[0]
    qx, sx = quantize_activation_groups(x.float(), 32)
    halves = k // Q6K_SUB
    xq = qx.to(torch.int64).view(m, halves, Q6K_SUB)
    w = q.to(torch.int64).view(n, halves, Q6K_SUB)
    sums = torch.einsum("mhk,nhk->mnh", xq.double(), w.double()).to(torch.int64)  # exact: below 2**53
    centred = sums - 32 * xq.sum(dim=2)[:, None, :]
    t = (centred * sub_scales.to(torch.int64)[None]).view(m, n, halves // 2, 2).sum(dim=3)
    d = super_scales.float().repeat_interleave(Q4K_SUPER, dim=1)  # [N, G]
    acc = torch.zeros(m, n, dtype=torch.float32)
    for g in range(k // 32):
        acc = acc + (t[:, :, g].float() * sx[:, g:g + 1].float()) * d[:, g][None]
    return acc if bias is None else acc + bias.float()


def dequantize_q6k(q: Tensor, sub_scales: Tensor, super_scales: Tensor) -> Tensor:
    """float32 weights d * s * (q - 32), as GGUF's Q6_K dequantizer gives them."""
    scale = super_scales.float().repeat_interleave(Q6K_SUB, dim=1) * sub_scales.float()
    return (scale.repeat_interleave(Q6K_SUB, dim=1) * (q.float() - 32))


def pack_int4(q: Tensor) -> Tensor:
    """int4 values (int8 [N, K] in [0, 15]) -> uint8 [N, ceil(K / 2)], two a byte (see the
    module docstring); the unused high nibble of an odd row's last byte is 0."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise QuasarError(f"pack_int4 expects a 2-D int8 tensor, got {q.dim()}-D {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise QuasarError("pack_int4: values must lie in [0, 15]")
    n, k = q.shape
    u = q.to(torch.uint8)
    if k % 2:
        u = torch.cat([u, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor, in_features: int) -> Tensor:
    """The inverse of ``pack_int4``: int8 [N, in_features] in [0, 15]."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] != -(-in_features // 2):
        raise QuasarError(f"unpack_int4: expected uint8 [N, {-(-in_features // 2)}], "
                          f"got {packed.dtype} {tuple(packed.shape)}")
    lo = (packed & 15).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    return torch.stack([lo, hi], dim=2).view(packed.shape[0], -1)[:, :in_features].contiguous()


def w4_weight_bytes(out_features: int, in_features: int, group: int, scale_bytes: int = 2, q4k: bool = False) -> int:
    """Bytes a step reads for one W4A8 weight: the nibbles, each group's scale and offset (in
    the Q4_K form 6 bits each, and two float16 a superblock)."""
    groups = n_groups(in_features, group)
    params = 3 * groups // 2 + 2 * 2 * (groups // Q4K_SUPER) if q4k else groups * 2 * scale_bytes
    return out_features * (-(-in_features // 2) + params)
