"""W8A8 linear layer: int8 per-channel weights, int8 per-token activations, int32 GEMM.

The layer's state_dict is exactly the compressed-tensors "int-quantized" layout
(``weight`` int8 [out, in], ``weight_scale`` float32 [out, 1], optional ``bias``), so a
saved model is what vLLM loads. Kernel-specific data (the CPU's ``128 * rowsum(W)``
correction, CUDA's zero-padded weight) are *not* buffers: they are built lazily on the
first forward and cached on the module, keyed by the weight tensor's identity and
version counter and by the backend, and dropped by a ``load_state_dict`` hook; so
loading, ``.to()``, reassigning or editing ``weight`` in place all rebuild them.
``repack()`` forces it; call it after editing an inference-mode tensor in place (those
keep no version counter).

On the ``cpu`` backend, forward runs one fused C++ op (``quasar.quant.ext``, built on
first use and cached; ``QUASAR_NO_EXT=1`` or a missing compiler falls back to the
PyTorch ops below) that gives the same bits as quantize_activation + GEMM +
scale_output, so backends, batch sizes and the fallback all agree. Whether it is used
is decided when the layer packs its weights. Inputs that require grad (with grad
enabled) take the PyTorch path.

Numerics (see DESIGN.md "Numerics"): the int32 product is exact and the quantizer and
epilogue are elementwise or per-row, so a token's output is bitwise the same whether it
is computed alone or with other tokens, and the same on every backend of one device.

``act_bits = 15`` (W8A15: chosen for the MLP down projection, whose inputs int8 serves
worst) quantizes activations to 15 bits (|q| <= 16383) and splits them as q = 128 * hi + lo
with hi, lo int8: two exact int8 GEMMs over the same weight, combined in int64. Weights,
bytes read per step and every kernel stay int8; only the GEMM work doubles.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.quant.kernels import BACKENDS, MAX_IN_FEATURES, get_kernel

__all__ = [
    "ACT_BITS",
    "BACKEND_NAMES",
    "Int8Linear",
    "quantize_activation",
    "split_mm",
    "quantize_weight",
    "scale_output",
    "set_backend",
]

BACKEND_NAMES = ("auto", *BACKENDS)
# Rows whose max is below 127 * _MIN_SCALE get scale _MIN_SCALE instead of dividing by ~0.
_MIN_SCALE = 1e-12


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per output channel: scale = max|w_row| / 127 (1.0 for zero rows)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise QuasarError(f"quantize_weight expects a 2-D float tensor, got {w.dim()}-D {w.dtype}")
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w32 / scale).clamp_(-127, 127).to(torch.int8)
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


def _version(t: Tensor) -> int | None:
    """In-place edits bump a tensor's version; inference tensors have none (hook covers)."""
    try:
        return t._version
    except RuntimeError:
        return None


class Int8Linear(nn.Module):
    """Drop-in replacement for ``nn.Linear`` computing W8A8 with int32 accumulation."""

    weight: Tensor
    weight_scale: Tensor
    bias: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        act_bits: int = 8,
    ) -> None:
        super().__init__()
        if act_bits not in ACT_BITS:
            raise QuasarError(f"Int8Linear act_bits must be one of {ACT_BITS}, got {act_bits!r}")
        self.act_bits = act_bits
        if not 0 < in_features <= MAX_IN_FEATURES:
            raise QuasarError(
                f"Int8Linear in_features must be in 1..{MAX_IN_FEATURES} for exact int32 "
                f"accumulation, got {in_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.backend = _check_backend(backend)
        self.register_buffer(
            "weight", torch.zeros((out_features, in_features), dtype=torch.int8, device=device)
        )
        self.register_buffer(
            "weight_scale", torch.ones((out_features, 1), dtype=torch.float32, device=device)
        )
        self.register_buffer(
            "bias", torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None
        )
        # (requested backend, weight tensor, its version, mm function, packed weight,
        # fused (op, extra args) or None); holding the tensor keeps the identity check
        # safe from address reuse.
        self._packed: tuple[str, Tensor, int | None, Any, Any, Any] | None = None
        self.register_load_state_dict_post_hook(_drop_packed)

    @classmethod
    def from_float(cls, linear: nn.Linear, backend: str = "auto", act_bits: int = 8) -> "Int8Linear":
        """Quantize a float linear layer (smoothing, if any, must already be folded in)."""
        if not isinstance(linear, nn.Linear):
            raise QuasarError(
                f"Int8Linear.from_float expects nn.Linear, got {type(linear).__name__}"
            )
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            backend=backend,
            device=linear.weight.device,
            act_bits=act_bits,
        )
        q, scale = quantize_weight(linear.weight)
        layer.weight.copy_(q)
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        return layer

    def dequantized_weight(self) -> Tensor:
        """float32 weight as the GEMM sees it: for error measurement and smoothing search."""
        return self.weight.float() * self.weight_scale.float()

    def resolved_backend(self) -> str:
        """The concrete backend for the current device ("auto" picks cuda or cpu)."""
        on_cuda = self.weight.is_cuda
        if self.backend == "auto":
            return "cuda" if on_cuda else "cpu"
        if self.backend != "reference" and (self.backend == "cuda") != on_cuda:
            raise QuasarError(
                f"Int8Linear backend {self.backend!r} cannot run on device {self.weight.device}"
            )
        return self.backend

    def repack(self) -> Any:
        """Rebuild the kernel's weight layout now (otherwise done lazily on forward)."""
        name = self.resolved_backend()
        weight = self._buffers["weight"]
        kernel = get_kernel(name)
        packed = kernel.pack(weight)
        fused = kernel.fused(packed) if kernel.fused is not None else None
        self._packed = (self.backend, weight, _version(weight), kernel.mm, packed, fused)
        return self._packed

    def packed(self) -> tuple[str, Tensor, int | None, Any, Any, Any]:
        """The kernel's weight layout for the current weight and backend, rebuilt when
        either changed since it was made (see ``repack``)."""
        c, weight = self._packed, self._buffers["weight"]
        if c is None or c[0] != self.backend or c[1] is not weight or c[2] != _version(weight):
            c = self.repack()
        return c

    def forward(self, x: Tensor) -> Tensor:
        """Quantize x per token, int8 GEMM, ``acc * s_w * s_x`` (+ bias), in x's dtype."""
        if x.shape[-1] != self.in_features or not x.is_floating_point():
            raise QuasarError(
                f"Int8Linear expects float input [..., {self.in_features}], "
                f"got {x.dtype} {tuple(x.shape)}"
            )
        buffers = self._buffers  # direct dict access: this runs per layer per token
        weight, c = buffers["weight"], self.packed()
        fused = c[5]
        if fused is not None and not (x.requires_grad and torch.is_grad_enabled()):
            # The `cpu` backend's C++ op (quasar.quant.ext): same bits, one call.
            return fused[0](x, weight, buffers["weight_scale"], buffers["bias"], *fused[1], self.act_bits)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        qx, sx = quantize_activation(x2, self.act_bits)
        acc = c[3](qx, c[4]) if self.act_bits == 8 else split_mm(c[3], c[4], qx)
        y = scale_output(acc, sx, buffers["weight_scale"], buffers["bias"], x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, backend={self.backend!r}"
            + (f", act_bits={self.act_bits}" if self.act_bits != 8 else "")
        )


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


def _drop_packed(module: nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: the packed layout is stale once weights are reloaded."""
    module._packed = None


def _check_backend(name: str) -> str:
    if name not in BACKEND_NAMES:
        choices = ", ".join(BACKEND_NAMES)
        raise QuasarError(f"unknown int8 backend {name!r}; choose one of {choices}")
    if name == "cuda" and not torch.cuda.is_available():
        raise QuasarError("int8 backend 'cuda' requested but CUDA is not available")
    return name


def set_backend(module: nn.Module, name: str) -> int:
    """Select the kernel backend of every Int8Linear under ``module``; returns how many."""
    name = _check_backend(name)
    count = 0
    for sub in module.modules():
        if isinstance(sub, Int8Linear):
            sub.backend = name
            sub._packed = None
            count += 1
    return count
