"""W4A8 linear layer: 4-bit affine weights in groups along the input, int8 activations per
token and group, exact integer group sums (quasar.runtime.w4a8_numerics is the contract).

State: ``qweight`` uint8 [out, ceil(in / 2)] (two weights a byte, ``pack_int4``), ``scales``
and ``offsets`` float16 [out, groups] (w = scale * q + offset), optional ``bias``. The C++
op (quasar.kernels.ext, when built) packs them once more into its own streaming layout on the
first forward, and asks the OS to reclaim the stored form's pages (``ext.release_pages``);
without it (or for a row of ragged groups) the layer runs the float64 reference, the same
bits, slowly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.kernels import ext
from quasar.runtime.w4a8_numerics import (GROUP_SIZES, SCALE_DTYPE, as_group_params, dequantize_w4, n_groups,
                                        pack_int4, quantize_weight_w4, reference_linear_w4a8, symmetric_as_affine,
                                        unpack_int4)

__all__ = ["W4A8Linear"]


class W4A8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group: int, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if group not in GROUP_SIZES:
            raise QuasarError(f"W4A8 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group!r}")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        g = n_groups(in_features, group)
        self.register_buffer("qweight", torch.zeros(out_features, -(-in_features // 2), dtype=torch.uint8,
                                                    device=device))
        self.register_buffer("scales", torch.ones(out_features, g, dtype=SCALE_DTYPE, device=device))
        self.register_buffer("offsets", torch.zeros(out_features, g, dtype=SCALE_DTYPE, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self._kernel_packing: tuple | None = None  # (qweight identity, the op's packed tensor)

    @classmethod
    def from_groups(cls, q: Tensor, scales: Tensor, offsets: Tensor, group: int,
                    bias: Tensor | None = None) -> "W4A8Linear":
        """A layer holding affine groups: q [out, in] in [0, 15], scales and offsets [out,
        groups] (a 4-bit GGUF's own blocks: quasar.models.gguf_groups), stored as float16
        (exact for Q4_0 / Q4_1, whose scales are float16 in the file; rounded once else)."""
        out_features, in_features = q.shape
        if scales.shape != (out_features, n_groups(in_features, group)) or offsets.shape != scales.shape:
            raise QuasarError(f"W4A8 groups: scales {tuple(scales.shape)} and offsets {tuple(offsets.shape)} do "
                              f"not fit a [{out_features}, {in_features}] weight in groups of {group}")
        layer = cls(in_features, out_features, group, bias is not None)
        layer.qweight = pack_int4(q.to(torch.int8))
        layer.scales, layer.offsets = as_group_params(scales), as_group_params(offsets, "offsets")
        if bias is not None:
            layer.bias = bias.detach().float().clone()
        return layer

    @classmethod
    def from_float(cls, linear: nn.Linear, group: int = 32) -> "W4A8Linear":
        """Round a float layer to symmetric int4 groups (round to nearest; no GPTQ yet)."""
        q, s = quantize_weight_w4(linear.weight, group)
        return cls.from_groups(*symmetric_as_affine(q, s), group, linear.bias)

    def dequantized_weight(self) -> Tensor:
        return dequantize_w4(unpack_int4(self.qweight, self.in_features), self.scales, self.group, self.offsets)

    def op_and_packing(self):
        """The C++ op and this weight in its layout (packed on first use, kept while the
        buffers stay the same tensors), or None without the op or for ragged groups. The
        fused decoder step streams the same packing."""
        op = ext.w4a8_linear_op() if self.in_features % self.group == 0 else None  # the op takes whole groups
        if op is None:
            return None
        key = (self.qweight.data_ptr(), self.scales.data_ptr(), self.offsets.data_ptr())
        if self._kernel_packing is None or self._kernel_packing[0] != key:
            q = unpack_int4(self.qweight, self.in_features)
            self._kernel_packing = (key, ext.pack_w4(q, self.scales, self.offsets, self.group))
            # Steps read only the packing: let the OS drop the stored form's pages (a memory-
            # mapped checkpoint's come back from the file if touched), so the weight is resident
            # once, not twice (at 8B the difference is 4 GB).
            for t in (self.qweight, self.scales, self.offsets):
                ext.release_pages(t)
        return op, self._kernel_packing[1]

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise QuasarError(f"W4A8Linear expects {self.in_features} input features, got {x.shape[-1]}")
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        kernel = self.op_and_packing() if x2.shape[0] else None
        if kernel is not None:
            op, packed = kernel
            y = op(x2, packed, self.out_features, self.in_features, self.group, self.bias)
        else:
            q = unpack_int4(self.qweight, self.in_features)
            y = reference_linear_w4a8(x2, q, self.scales, self.offsets, self.bias, self.group)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, " \
               f"bias={self.bias is not None}"
