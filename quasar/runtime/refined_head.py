"""The W4A8 verifier's output head: 4-bit logits for the whole vocabulary, the likeliest
recomputed from int8 weights.

The head is the largest matrix a step reads (151936 x 1536 at 1.5B: 233 MB int8, 22% of a
W4A8 step). 4-bit alone it costs too much fidelity: clearly less top-1 agreement and about
twice the KL of an int8 head, worse than llama.cpp's own Q4_K_M file. But what decides the
next token and most of the distribution's mass is a few dozen logits.
So a step reads the 4-bit head (fitted groups, ``fit_weight_w4_affine``: 146 MB), takes each
row's ``top_k`` largest logits, and replaces them with the int8 head's logits for those
tokens, which reads ``top_k`` rows of the int8 matrix (98 KB), not all of it. With top_k = 64
the top-1 agreement is the int8 head's and the KL close to it (docs/bench/HISTORY.md).

Exactness: a row's logits depend on that row alone. The tokens it refines are all those whose
4-bit logit is at least its top_k-th largest (ties included, so the set does not depend on
how a top-k routine orders equal values), and each refined logit is the int8 head's for that
token bit for bit: the exact integer dot product, then Int8Linear's epilogue in its order. So
greedy speculative decoding still equals greedy decoding of the same verifier.

State: ``approx`` (W4A8Linear) and ``exact`` (Int8Linear, never run whole: ``streamed`` is
False, so the bytes a step reads count only the 4-bit head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.kernels import ext
from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w8a8_numerics import quantize_activation, quantize_weight
from quasar.runtime.w4a8 import W4A8Linear
from quasar.runtime.w4a8_numerics import SCALE_DTYPE, fit_weight_w4_affine, n_groups

DEFAULT_TOP_K = 64
# weights fitted at a time (the fit's float32 temporaries about 10x this many): a vocabulary-
# sized head is never widened whole
_FIT_ELEMENTS = 1 << 22
# (row, token) pairs recomputed at a time: a fidelity window of 2048 rows refines 131k pairs,
# whose int32 operands would be 1.6 GB at once at 1.5B
_EXACT_PAIRS = 8192


def op_applies(y: Tensor, top_k: int) -> bool:
    """Whether a head's C++ refinement takes logits y [R, V] and top_k: contiguous float32 on
    the CPU, top_k within the row scan's limit."""
    return y.device.type == "cpu" and y.dtype == torch.float32 and y.is_contiguous() and top_k <= ext.MAX_ROW_TOP_K


def kth_largest(y: Tensor, top_k: int) -> Tensor:
    """Each row's top_k-th largest logit [R, 1], torch.topk's (a NaN ranks above every number):
    the threshold both heads refine from, in torch and in C++ (csrc/head/refine_rows.cpp)."""
    return y.topk(top_k, dim=1).values[:, -1:]


def refine_in_torch(y: Tensor, x2: Tensor, top_k: int,
                    exact_logits: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """The heads' torch refinement: each row's logits at least its kth_largest (ties included)
    become exact_logits(x2, rows, cols), in place."""
    rows, cols = torch.nonzero(y >= kth_largest(y, top_k), as_tuple=True)
    y[rows, cols] = exact_logits(x2, rows, cols)
    return y


class RefinedHead(nn.Module):
    def __init__(self, in_features: int, out_features: int, top_k: int = DEFAULT_TOP_K, group: int = 32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= out_features:
            raise QuasarError(f"the refined head's top_k must be an integer in [1, {out_features}], got {top_k!r}")
        self.in_features, self.out_features, self.top_k = in_features, out_features, top_k
        self.approx = W4A8Linear(in_features, out_features, group, bias=False, device=device)
        self.exact = Int8Linear(in_features, out_features, bias=False, device=device)
        self.exact.streamed = False  # only top_k rows of it are read a step

    @classmethod
    def from_float(cls, weight: Tensor, top_k: int = DEFAULT_TOP_K, group: int = 32) -> "RefinedHead":
        """Both heads of a float weight [vocab, hidden] (memory-mapped is fine: it is read a
        block of rows at a time)."""
        out_features, in_features = weight.shape
        head = cls(in_features, out_features, top_k, group, device="meta")  # both replaced below
        q = torch.empty(out_features, in_features, dtype=torch.int8)
        scales, offsets = (torch.empty(out_features, n_groups(in_features, group), dtype=SCALE_DTYPE)
                           for _ in range(2))
        rows = max(1, _FIT_ELEMENTS // in_features)
        for r in range(0, out_features, rows):
            q[r:r + rows], scales[r:r + rows], offsets[r:r + rows] = fit_weight_w4_affine(weight[r:r + rows], group)
        head.approx = W4A8Linear.from_groups(q, scales, offsets, group)
        q8, scale8 = quantize_weight(weight)
        head.exact.weight, head.exact.weight_scale = q8, scale8
        return head

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        y = self.refine(self.approx(x2).contiguous(), x2)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def refine(self, y: Tensor, x2: Tensor, use_op: bool = True) -> Tensor:
        """4-bit logits y [R, V] of inputs x2 [R, in] with each row's logits at least its
        top_k-th largest replaced by the int8 head's, in place. By the C++ op where it runs (one
        pass a row, where torch needs several), else (``use_op=False``
        too: the op's contract, for tests) in torch."""
        if not y.shape[0]:
            return y
        op = ext.refine_head_rows_op() if use_op and op_applies(y, self.top_k) else None
        if op is not None:
            qx, sx = quantize_activation(x2)
            op(y, qx, sx, self.exact.weight, self.exact.weight_scale, self.top_k)
            return y
        return refine_in_torch(y, x2, self.top_k, self.exact_logits)

    def exact_logits(self, x2: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
        """The int8 head's logits of token cols[i] for input row rows[i]: per-token int8
        activations, the exact integer dot product, ``(float(acc) * s_w) * s_x`` (Int8Linear)."""
        qx, sx = quantize_activation(x2)
        acc = torch.empty(rows.numel(), dtype=torch.int32)
        for i in range(0, rows.numel(), _EXACT_PAIRS):
            r, c = rows[i:i + _EXACT_PAIRS], cols[i:i + _EXACT_PAIRS]
            acc[i:i + _EXACT_PAIRS] = (self.exact.weight[c].to(torch.int32) * qx[r].to(torch.int32)).sum(1)
        return (acc.float() * self.exact.weight_scale[cols, 0]) * sx[rows, 0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, top_k={self.top_k}"
