"""A GGUF Q6_K tensor as the W4A8 kernels stream it: 6-bit weights at the file's own
precision (w = d * s * (q - 32)), int8 activations per token and group of 32.

A Q4_K_M file keeps half of the value and down projections and the output head in Q6_K.
The faithful W4A8 verifier never rounds them to 4 bits; streamed in this form they cost the
file's 6.5625 bits a weight instead of int8's 8 (w4a8_numerics.reference_linear_q6k is the
contract; csrc/gemm_w4a8/w4a8_gemm.h the kernels' layout).

State: ``qweight`` uint8 [out, in] (one 6-bit value a byte), ``scales`` int8 [out, in / 16],
``super_scales`` float16 [out, in / 256], optional ``bias``. It is a ``W4A8Linear`` to the
code that plans steps (the fused step, the step cost, checkpoints): the same kernels, op and
packing cache, another form.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.kernels import ext
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w4a8_numerics import Q6K_FORM, Q6K_SUB, SCALE_DTYPE, dequantize_q6k, reference_linear_q6k

SUPERBLOCK = 256


class Q6KLinear(W4A8Linear):
    form = Q6K_FORM
    q4k = False
    STORED = ("qweight", "scales", "super_scales")

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None) -> None:
        nn.Module.__init__(self)
        if in_features % SUPERBLOCK:
            raise QuasarError(f"a Q6_K layer needs rows of whole {SUPERBLOCK}-weight superblocks, got {in_features}")
        self.in_features, self.out_features, self.group = in_features, out_features, 32
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(out_features, in_features // Q6K_SUB, dtype=torch.int8,
                                                  device=device))
        self.register_buffer("super_scales", torch.ones(out_features, in_features // SUPERBLOCK, dtype=SCALE_DTYPE,
                                                        device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self._kernel_packing = None

    @classmethod
    def from_blocks(cls, q: Tensor, sub_scales: Tensor, super_scales: Tensor,
                    bias: Tensor | None = None) -> "Q6KLinear":
        """A layer holding a Q6_K matrix's values (quasar.models.gguf_groups.q6k_blocks): q
        [out, in] in [0, 63], int8 sub_scales [out, in / 16], float16 super_scales [out, in / 256]."""
        out_features, in_features = q.shape
        layer = cls(in_features, out_features, bias is not None)
        layer._take_buffers("Q6_K", bias, qweight=q, scales=sub_scales, super_scales=super_scales)
        return layer

    def group_params(self):
        raise QuasarError("a Q6_K layer has no affine group parameters (see reference_linear_q6k)")

    def stored(self) -> list[Tensor]:
        return [getattr(self, name) for name in self.STORED]

    def step_bytes(self) -> int:
        """What a step streams: 6 bits a weight, a byte a 16, two bytes a 256."""
        k = self.in_features
        return self.out_features * (k * 6 // 8 + k // Q6K_SUB + 2 * (k // SUPERBLOCK))

    def dequantized_weight(self) -> Tensor:
        return dequantize_q6k(self.qweight, self.scales, self.super_scales)

    def _pack(self) -> Tensor:
        return ext.pack_w4_q6k(*self.stored())

    def _reference(self, x2: Tensor) -> Tensor:
        return reference_linear_q6k(x2, *self.stored(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

