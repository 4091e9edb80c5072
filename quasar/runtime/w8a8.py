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

On the ``cpu`` backend, forward runs one fused C++ op (``quasar.kernels.ext``, built on
first use and cached; ``QUASAR_NO_EXT=1`` or a missing compiler falls back to the
PyTorch ops below) that gives the same bits as quantize_activation + GEMM +
scale_output, so backends, batch sizes and the fallback all agree. Whether it is used
is decided when the layer packs its weights. Inputs that require grad (with grad
enabled) take the PyTorch path.

Numerics (see ARCHITECTURE.md "Numerics" and ``quasar.runtime.w8a8_numerics``): the int32 product is exact and the quantizer and
epilogue are elementwise or per-row, so a token's output is bitwise the same whether it
is computed alone or with other tokens, and the same on every backend of one device.

``act_bits = 15`` (W8A15: chosen for the MLP down projection, whose inputs int8 serves
worst) quantizes activations to 15 bits (|q| <= 16383) and splits them as q = 128 * hi + lo
with hi, lo int8: two exact int8 GEMMs over the same weight, combined in int64. Weights,
bytes read per step and every kernel stay int8; only the GEMM work doubles.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.runtime.w8a8_backends import BACKENDS, get_kernel
from quasar.runtime.w8a8_numerics import (ACT_BITS, MAX_IN_FEATURES, quantize_activation, quantize_weight, scale_output,
                                   split_mm)

__all__ = ["BACKEND_NAMES", "Int8Linear", "Packing", "set_backend"]

BACKEND_NAMES = ("auto", *BACKENDS)


class Packing(NamedTuple):
    """An Int8Linear's weight in its kernel's layout, and what it was made from."""

    backend: str  # the backend requested when it was made ("auto" included)
    weight: Tensor  # the weight tensor it was made from; held, so its identity check is safe
    version: int | None  # that tensor's version counter then
    mm: Any  # the kernel's GEMM: mm(qx, packed) -> int32 [M, N]
    packed: Any  # the kernel's packed weight
    fused: tuple | None  # (op, extra args) of a fused C++ layer op, or None


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
        self._packing: Packing | None = None  # built on first use, see packing()
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

    def repack(self) -> Packing:
        """Rebuild the kernel's weight layout now (otherwise done lazily on forward)."""
        name = self.resolved_backend()
        weight = self._buffers["weight"]
        kernel = get_kernel(name)
        packed = kernel.pack(weight)
        fused = kernel.fused(packed) if kernel.fused is not None else None
        self._packing = Packing(self.backend, weight, _version(weight), kernel.mm, packed, fused)
        return self._packing

    def packing(self) -> Packing:
        """The kernel's weight layout for the current weight and backend, rebuilt when
        either changed since it was made (see ``repack``)."""
        c, weight = self._packing, self._buffers["weight"]
        if c is None or c.backend != self.backend or c.weight is not weight or c.version != _version(weight):
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
        weight, c = buffers["weight"], self.packing()
        if c.fused is not None and not (x.requires_grad and torch.is_grad_enabled()):
            # The `cpu` backend's C++ op (quasar.kernels.ext): same bits, one call.
            op, extra = c.fused
            return op(x, weight, buffers["weight_scale"], buffers["bias"], *extra, self.act_bits)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        qx, sx = quantize_activation(x2, self.act_bits)
        acc = c.mm(qx, c.packed) if self.act_bits == 8 else split_mm(c.mm, c.packed, qx)
        y = scale_output(acc, sx, buffers["weight_scale"], buffers["bias"], x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, backend={self.backend!r}"
            + (f", act_bits={self.act_bits}" if self.act_bits != 8 else "")
        )


def _drop_packed(module: nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: the packed layout is stale once weights are reloaded."""
    module._packing = None


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
            sub._packing = None
            count += 1
    return count
