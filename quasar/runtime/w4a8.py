"""W4A8 linear layer: 4-bit affine weights in groups along the input, int8 activations per
token and group, exact integer group sums (quasar.runtime.w4a8_numerics is the contract).

State: ``qweight`` uint8 [out, ceil(in / 2)] (two weights a byte, ``pack_int4``), ``scales``
and ``offsets`` float16 [out, groups] (w = scale * q + offset), optional ``bias``. In the Q4_K
form (``q4k``: a Q4_K file's own parameters, w4a8_numerics.Q4K_FORM) ``scales`` and
``offsets`` are the uint8 codes c and o and ``super_scales`` / ``super_offsets`` the float16
d and m [out, groups / 8]: scale = d * c, offset = m * o, exactly. The C++
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
from quasar.runtime.w4a8_numerics import (GROUP_SIZES, Q4K_FORM, Q4K_SUPER, SCALE_DTYPE, as_group_params,
                                        dequantize_w4, n_groups, pack_int4, q4k_group_params, quantize_weight_w4,
                                        reference_linear_w4a8, symmetric_as_affine, unpack_int4,
                                        w4_weight_bytes)

__all__ = ["W4A8Linear"]


class W4A8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group: int, bias: bool = False,
                 device: torch.device | str | None = None, q4k: bool = False) -> None:
        super().__init__()
        if group not in GROUP_SIZES:
            raise QuasarError(f"W4A8 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group!r}")
        if q4k and (group != 32 or in_features % (32 * Q4K_SUPER)):
            raise QuasarError(f"the Q4_K form needs groups of 32 and rows of whole 256-weight superblocks, got group "
                              f"{group} and {in_features} input features")
        self.in_features, self.out_features, self.group, self.q4k = in_features, out_features, group, q4k
        g = n_groups(in_features, group)
        self.register_buffer("qweight", torch.zeros(out_features, -(-in_features // 2), dtype=torch.uint8,
                                                    device=device))
        params = torch.uint8 if q4k else SCALE_DTYPE  # codes, or the float16 parameters themselves
        self.register_buffer("scales", torch.ones(out_features, g, dtype=params, device=device))
        self.register_buffer("offsets", torch.zeros(out_features, g, dtype=params, device=device))
        if q4k:
            self.register_buffer("super_scales", torch.ones(out_features, g // Q4K_SUPER, dtype=SCALE_DTYPE,
                                                            device=device))
            self.register_buffer("super_offsets", torch.zeros(out_features, g // Q4K_SUPER, dtype=SCALE_DTYPE,
                                                             device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self._kernel_packing: tuple | None = None  # (qweight identity, the op's packed tensor)

    @property
    def form(self) -> int:
        """The kernels' name for this weight's layout: its group size, or Q4K_FORM."""
        return Q4K_FORM if self.q4k else self.group

    def stored(self) -> list[Tensor]:
        """The buffers the op's packing is made from (not the bias)."""
        return [self.qweight, self.scales, self.offsets] + ([self.super_scales, self.super_offsets]
                                                           if self.q4k else [])

    def step_bytes(self) -> int:
        """What a step streams of this weight (the op's packing, padding lanes aside)."""
        return w4_weight_bytes(self.out_features, self.in_features, self.group, q4k=self.q4k)

    def group_params(self) -> tuple[Tensor, Tensor]:
        """Scales and offsets [out, groups] as the kernels use them (float16, or the Q4_K
        form's exact float32 products)."""
        if self.q4k:
            return q4k_group_params(self.scales, self.offsets, self.super_scales, self.super_offsets)
        return self.scales, self.offsets

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
    def from_q4k(cls, q: Tensor, scale_codes: Tensor, offset_codes: Tensor, super_scales: Tensor,
                 super_offsets: Tensor, bias: Tensor | None = None) -> "W4A8Linear":
        """A layer in the Q4_K form: q [out, in] in [0, 15], uint8 codes [out, in / 32], float16
        d and m [out, in / 256] (quasar.models.gguf_groups.q4k_codes)."""
        out_features, in_features = q.shape
        layer = cls(in_features, out_features, 32, bias is not None, q4k=True)
        layer._take_buffers("W4A8 Q4_K", bias, scales=scale_codes, offsets=offset_codes, super_scales=super_scales,
                            super_offsets=super_offsets)
        layer.qweight = pack_int4(q.to(torch.int8))
        return layer

    def _take_buffers(self, what: str, bias: Tensor | None, **tensors: Tensor) -> None:
        """Copies of `tensors` as the buffers of those names, each of the shape and dtype this
        layer registered (else an error naming it), and of the bias as float32."""
        for name, t in tensors.items():
            want = getattr(self, name)
            if t.shape != want.shape or t.dtype != want.dtype:
                raise QuasarError(f"{what} {name}: expected {want.dtype} {tuple(want.shape)}, got {t.dtype} "
                                  f"{tuple(t.shape)}")
            setattr(self, name, t.detach().contiguous().clone())
        if bias is not None:
            self.bias = bias.detach().float().clone()

    @classmethod
    def from_float(cls, linear: nn.Linear, group: int = 32) -> "W4A8Linear":
        """Round a float layer to symmetric int4 groups (round to nearest; no GPTQ yet)."""
        q, s = quantize_weight_w4(linear.weight, group)
        return cls.from_groups(*symmetric_as_affine(q, s), group, linear.bias)

    def dequantized_weight(self) -> Tensor:
        scales, offsets = self.group_params()
        return dequantize_w4(unpack_int4(self.qweight, self.in_features), scales, self.group, offsets)

    def op_and_packing(self):
        """The C++ op and this weight in its layout (packed on first use, kept while the
        buffers stay the same tensors), or None without the op or for ragged groups. The
        fused decoder step streams the same packing."""
        op = ext.w4a8_linear_op() if self.in_features % self.group == 0 else None  # the op takes whole groups
        if op is None:
            return None
        stored = self.stored()
        key = tuple(t.data_ptr() for t in stored)
        if self._kernel_packing is None or self._kernel_packing[0] != key:
            self._kernel_packing = (key, self._pack())
            # Steps read only the packing: let the OS drop the stored form's pages (a memory-
            # mapped checkpoint's come back from the file if touched), so the weight is resident
            # once, not twice (at 8B the difference is 4 GB).
            for t in stored:
                ext.release_pages(t)
        return op, self._kernel_packing[1]

    def _pack(self) -> Tensor:
        """The stored weight in the op's layout (ext.pack_w4 / pack_w4_q4k)."""
        q = unpack_int4(self.qweight, self.in_features)
        if self.q4k:
            return ext.pack_w4_q4k(q, *self.stored()[1:])
        return ext.pack_w4(q, self.scales, self.offsets, self.group)

    def _reference(self, x2: Tensor) -> Tensor:
        """The reference numbers of x2 [M, in] (what every kernel gives, slowly)."""
        q = unpack_int4(self.qweight, self.in_features)
        return reference_linear_w4a8(x2, q, *self.group_params(), self.bias, self.group)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise QuasarError(f"{type(self).__name__} expects {self.in_features} input features, got {x.shape[-1]}")
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        kernel = self.op_and_packing() if x2.shape[0] else None
        if kernel is not None:
            op, packed = kernel
            y = op(x2, packed, self.out_features, self.in_features, self.form, self.bias)
        else:
            y = self._reference(x2)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, " \
               f"bias={self.bias is not None}" + (", q4k=True" if self.q4k else "")
