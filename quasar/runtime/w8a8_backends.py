"""int8 x int8 -> int32 GEMM, one small (pack, mm) pair per backend.

Every backend computes the same exact integer product ``qx @ weight.T`` (int32), so a
token's result never depends on the backend or on how many tokens share the call; only
speed differs. ``pack`` turns the int8 weight [N, K] into what ``mm`` wants (built once
and cached by the caller, never saved); ``mm(qx [M, K] int8, packed)`` returns int32
[M, N], possibly as a non-contiguous view.

CPU: oneDNN's ``torch._int_mm`` accepts any shape and is fastest with the *unsigned*
operand on the left; two exact variants use that differently (s8, u8x below) and
``cpu`` picks per call by M (see the policy note). oneDNN without VNNI may saturate
u8 x s8 pairs in int16, so each variant is checked once per process on extreme values
and dropped if inexact. ``cpu_fused`` hands Int8Linear the same choice as a single C++
call (``quasar.kernels.ext``) when that is available. CUDA: cuBLASLt via ``torch._int_mm``
with padding.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from quasar.kernels import ext
from quasar.runtime.w8a8_numerics import MAX_IN_FEATURES, reference_mm

__all__ = [
    "BACKENDS",
    "Kernel",
    "MAX_IN_FEATURES",
    "CPU_VARIANTS",
    "exact_cpu_variants",
    "get_kernel",
    "reference_mm",
]

# The u8 trick sums (W + 128) * qx, |.| <= 255 * 128 * K, before the correction.
_U8_MAX_K = (2**31 - 1) // (255 * 128)

Packed = tuple


class Kernel(NamedTuple):
    """A backend's weight packing and its int8 GEMM, and optionally a fused whole layer.

    ``fused(packed)`` returns ``(op, extra_args)`` or None; Int8Linear then computes
    ``op(x, weight, weight_scale, bias, *extra_args)`` in place of quantize, ``mm`` and
    ``scale_output``, and the op must give the same bits.
    """

    pack: Callable[[Tensor], Packed]
    mm: Callable[[Tensor, Packed], Tensor]
    fused: Callable[[Packed], tuple | None] | None = None


# ---------------------------------------------------------------- reference
def reference_pack(weight: Tensor) -> Packed:
    """The reference needs no layout change."""
    return (weight,)



# ---------------------------------------------------------------- cpu variants
# Two exact ways to get int32 qx @ W.T out of oneDNN's ``_int_mm`` (for K >= 2: see
# ``_pick``); oneDNN's fast VNNI kernels want the *unsigned* operand on the left.
def s8_pack(weight: Tensor) -> Packed:
    """s8 x s8 uses the column-major [K, N] view ``weight.t()``: no copy."""
    return (weight,)


def s8_mm(qx: Tensor, packed: Packed) -> Tensor:
    """Plain s8 x s8 GEMM (oneDNN compensates internally)."""
    return torch._int_mm(qx, packed[0].t())


_ROWSUM_CHUNK = 4096  # rows summed at a time: an int32 copy of a vocabulary-wide weight is GBs


def u8x_pack(weight: Tensor) -> Packed:
    """Weight as is, plus 128 * rowsum(W) to undo the +128 shift of the activation."""
    comp = torch.empty(weight.shape[0], dtype=torch.int32, device=weight.device)
    for i in range(0, weight.shape[0], _ROWSUM_CHUNK):
        torch.sum(weight[i:i + _ROWSUM_CHUNK], dim=1, dtype=torch.int32, out=comp[i:i + _ROWSUM_CHUNK])
    return (weight, comp.mul_(128).unsqueeze(0))


def u8x_mm(qx: Tensor, packed: Packed) -> Tensor:
    """(qx + 128) x W.T - 128 * rowsum(W): hits oneDNN's u8 x s8 GEMV at M = 1."""
    weight, comp = packed
    ux = qx.view(torch.uint8) ^ 128  # two's complement: q + 128 as uint8
    return torch._int_mm(ux, weight.t()).sub_(comp)


CPU_VARIANTS: dict[str, tuple[Callable[[Tensor], Packed], Callable[[Tensor, Packed], Tensor]]] = {
    "s8": (s8_pack, s8_mm),
    "u8x": (u8x_pack, u8x_mm),
}


def _variant_exact(name: str) -> bool:
    """Compare a variant with the reference on extreme values that saturate int16 pairs."""
    pack, mm = CPU_VARIANTS[name]
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 131, 37), (6, 131, 37), (40, 1100, 70)):
        qx = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        qx[0], w[0], w[1] = -128, 127, -128  # 255 * -128 * 2 overflows int16
        if m > 1:
            qx[1] = 127
        try:
            if not torch.equal(mm(qx, pack(w)), reference_mm(qx, (w,))):
                return False
        except RuntimeError:  # e.g. a torch build without CPU _int_mm
            return False
    return True


_exact_variants: tuple[str, ...] | None = None


def exact_cpu_variants() -> tuple[str, ...]:
    """CPU variants that are exact on this machine (checked once per process).

    oneDNN without VNNI may saturate u8 x s8 pairs in int16; then we fall back.
    """
    global _exact_variants
    if _exact_variants is None:
        _exact_variants = tuple(v for v in CPU_VARIANTS if _variant_exact(v))
    return _exact_variants


# ---------------------------------------------------------------- cpu
# Policy, from `python scripts/tools/bench_kernels.py` (whole layer incl. quantization and
# epilogue): M = 1 -> u8x (oneDNN's u8 x s8 GEMV beats s8 x s8 on wide layers, ties on small
# ones); M > 1 -> s8 (u8x loses the GEMV and pays the shift). Neither needs a copy of the
# weight. A third variant, the transposed problem (W + 128) @ qx.T, has the fastest GEMM at
# M = 2..128 but returns a transposed view whose epilogue costs more than the GEMM gains,
# so it is not kept.
_PREFERENCE = {True: ("u8x", "s8"), False: ("s8", "u8x")}  # keyed by M == 1


def _pick(single_row: bool, k: int) -> str:
    if k == 1:  # torch 2.13's CPU _int_mm returns uninitialised memory when K == 1
        return "reference"
    ok = exact_cpu_variants()
    for name in _PREFERENCE[single_row]:
        if name in ok and (name == "s8" or k <= _U8_MAX_K):
            return name
    return "reference"


class CpuPacked(NamedTuple):
    """The ``cpu`` backend's layout: the variant for M == 1 and for M > 1, the weight itself
    (s8 reads its column-major view), u8x's correction 128 * rowsum(W) (or None), and the
    weight in the C++ op's tile layout (None without the op)."""

    one: str
    many: str
    weight: Tensor
    comp: Tensor | None
    tiles: Tensor | None = None


def cpu_pack(weight: Tensor) -> CpuPacked:
    k = weight.shape[1]
    one, many = _pick(True, k), _pick(False, k)
    # Steps of up to 16 rows read only the tiles, and longer ones are rare (the fused step's
    # GEMMs, prefill chunks included, read only the tiles too): the OS may drop the row-major
    # copy's pages (a memory-mapped checkpoint's come back from the file if oneDNN reads
    # them), so the weights are resident once, not twice. The row sums come first, and the
    # packing hands its source back a chunk at a time as it goes, so not even the packing
    # holds a weight twice (an 8B model's 0.6 GB head would otherwise top its decode peak).
    use_tiles = ext.small_m_supported()
    comp = u8x_pack(weight)[1] if "u8x" in (one, many) or use_tiles else None
    tiles = ext.pack_tiles(weight, release_source=True) if use_tiles else None
    if tiles is not None:
        ext.release_pages(weight)  # the pages tiles straddle
    return CpuPacked(one, many, weight, comp, tiles)


def cpu_mm(qx: Tensor, packed: CpuPacked) -> Tensor:
    """Dispatch on M; every variant is exact, so the choice never changes a result."""
    one, many, weight, comp, _ = packed
    name = one if qx.shape[0] == 1 else many
    if name == "u8x":
        return u8x_mm(qx, (weight, comp))
    if name == "s8":
        return s8_mm(qx, (weight,))
    return reference_mm(qx, (weight,))


def cpu_fused(packed: CpuPacked) -> tuple | None:
    """The C++ op of ``quasar.kernels.ext`` with the same variant choice as ``cpu_mm``, or None
    (disabled or not buildable). Where no oneDNN variant is exact (``reference``: CPUs
    without VNNI) the op's own kernel computes every M, exactly; K == 1 it takes as well."""
    one, many, _, comp, tiles = packed
    if tiles is None:
        return None
    op = ext.int8_linear_op()
    if op is None:
        return None
    ext.onednn_exact("s8" in exact_cpu_variants())  # the op's long steps avoid an inexact oneDNN
    return op, (comp, one == "u8x", many == "u8x", tiles)


# ---------------------------------------------------------------- cuda
def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def cuda_pack(weight: Tensor) -> Packed:
    """cuBLASLt needs K and N multiples of 8: zero-pad once (zeros keep the sum exact)."""
    n, k = weight.shape
    np_, kp = _round_up(n, 8), _round_up(k, 8)
    if (np_, kp) != (n, k):
        padded = weight.new_zeros((np_, kp))
        padded[:n, :k] = weight
        weight = padded
    return (weight.contiguous(), n, k)


def cuda_mm(qx: Tensor, packed: Packed) -> Tensor:
    """``torch._int_mm`` wants M > 16 and K % 8 == 0: pad rows/columns with zeros, slice.

    The weight goes in as the column-major view ``w.t()``, the layout cuBLASLt's int8
    path wants (a contiguous [K, N] copy is several times slower).
    """
    w, n, k = packed
    m = qx.shape[0]
    mp, kp = (m if m > 16 else 24), w.shape[1]
    if (mp, kp) != (m, k):
        padded = qx.new_zeros((mp, kp))
        padded[:m, :k] = qx
        qx = padded
    return torch._int_mm(qx, w.t())[:m, :n]


BACKENDS: dict[str, Kernel] = {
    "reference": Kernel(reference_pack, reference_mm),
    "cpu": Kernel(cpu_pack, cpu_mm, cpu_fused),
    "cuda": Kernel(cuda_pack, cuda_mm),
}


def get_kernel(name: str) -> Kernel:
    """Look up a concrete backend (not "auto")."""
    return BACKENDS[name]
