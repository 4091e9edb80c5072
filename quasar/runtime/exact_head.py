"""The faithful W4A8 verifier's output head: int8 logits for the whole vocabulary, the
likeliest recomputed from the file's own weights.

A step streams the head as an ``Int8Linear`` with 15-bit activations (its int8 per-channel
weights are at least as fine as the file's 6- or 8-bit blocks), or, where the file keeps it in
Q6_K, as those blocks themselves (``Q6KLinear``: the file's precision, 6.5625 bits a weight).
Per-token rounding of the final hidden state still moves the logits that decide the next token, so each row's
``top_k`` largest logits are recomputed from the float weights of those tokens (the float
model's own, i.e. the GGUF's values dequantized) and the unrounded hidden state, summed in
float64. That reads ``top_k`` rows of the float matrix a step, not all of it. With a tied
head those rows are the embedding table the verifier already holds, so it costs no bytes.

Exactness: a row's logits depend on that row alone. The refined tokens are all those whose
int8 logit is at least the row's top_k-th largest (ties included), and each refined logit is
one dot product over a contiguous row in a fixed order, rounded to float32: the same bits whether the
row is verified alone or with drafts, so greedy speculative decoding still equals greedy
decoding of the same verifier.

State: ``approx`` (Int8Linear, 15-bit activations, or Q6KLinear) and ``exact.weight``
(float32 [vocab, hidden]; a tied head stores none and reads the embedding module's table,
``TiedRows``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from quasar.errors import QuasarError
from quasar.kernels import ext
from quasar.runtime.q6k_linear import Q6KLinear
from quasar.runtime.refined_head import op_applies, refine_in_torch
from quasar.runtime.w8a8 import Int8Linear
from quasar.runtime.w8a8_numerics import quantize_weight

DEFAULT_TOP_K = 64
HEAD_ACT_BITS = 15
# (row, token) pairs recomputed at a time: the products of a 2048-row fidelity window would
# be gigabytes at once
_EXACT_PAIRS = 2048


class RowTable(nn.Module):
    """A float matrix read a few rows a step (``streamed`` False: not part of a step's bytes)."""

    streamed = False

    def __init__(self, weight: Tensor):
        super().__init__()
        self.register_buffer("weight", weight)


class TiedRows(nn.Module):
    """The rows of an embedding table, read through its module (so a state-dict load that
    replaces the table's tensor is seen), never stored twice."""

    streamed = False

    def __init__(self, embedding: nn.Embedding | None):
        super().__init__()
        self._embedding = (embedding,)  # a tuple: not registered as a submodule

    @property
    def weight(self) -> Tensor | None:
        embedding = self._embedding[0]
        return None if embedding is None else embedding.weight


class ExactTopHead(nn.Module):
    def __init__(self, in_features: int, out_features: int, top_k: int = DEFAULT_TOP_K,
                 tied: nn.Embedding | None = None, device: torch.device | str | None = None,
                 q6k: bool = False) -> None:
        super().__init__()
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= out_features:
            raise QuasarError(f"the exact head's top_k must be an integer in [1, {out_features}], got {top_k!r}")
        self.in_features, self.out_features, self.top_k = in_features, out_features, top_k
        self.tied = tied is not None
        self.approx = Q6KLinear(in_features, out_features, device=device) if q6k else \
            Int8Linear(in_features, out_features, bias=False, device=device, act_bits=HEAD_ACT_BITS)
        self.exact = TiedRows(tied) if self.tied else \
            RowTable(torch.empty(out_features, in_features, dtype=torch.float32, device=device))

    @classmethod
    def from_float(cls, weight: Tensor, top_k: int = DEFAULT_TOP_K,
                   tied: nn.Embedding | bool = False) -> "ExactTopHead":
        """The head of a float weight [vocab, hidden] (memory-mapped is fine: the int8 copy is
        rounded a block of rows at a time). ``tied``: `weight` is the embedding table, whose
        rows are read through that module (True: the module is not at hand; what loads the
        head gives it) instead of being stored twice."""
        out_features, in_features = weight.shape
        head = cls(in_features, out_features, top_k, device="meta")
        q, scale = quantize_weight(weight)
        head.approx.weight, head.approx.weight_scale = q, scale
        head._take_exact_rows(weight, tied)
        return head

    def _take_exact_rows(self, weight: Tensor, tied: nn.Embedding | bool) -> None:
        """The float rows the top logits are recomputed from: the embedding's (tied) or `weight`'s."""
        if tied is not False:
            self.tied, self.exact = True, TiedRows(None if tied is True else tied)
        else:
            self.tied, self.exact = False, RowTable(weight.float())

    @classmethod
    def from_q6k(cls, blocks: tuple, weight: Tensor, top_k: int = DEFAULT_TOP_K,
                 tied: nn.Embedding | bool = False) -> "ExactTopHead":
        """The head of a Q6_K file's matrix: the approximate logits from its own 6-bit blocks
        (``blocks``: q, scales, d as quasar.models.gguf.q6k_readers gives them) instead of an
        int8 copy; `weight` (its dequantized float rows) and ``tied`` as ``from_float``."""
        out_features, in_features = weight.shape
        head = cls(in_features, out_features, top_k, device="meta", q6k=True)
        head.approx = Q6KLinear.from_blocks(*blocks)
        head._take_exact_rows(weight, tied)
        return head

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        y = self.refine(self.approx(x2).float().contiguous(), x2)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def refine(self, y: Tensor, x2: Tensor, use_op: bool = True) -> Tensor:
        """int8 logits y [R, V] of inputs x2 [R, in] with each row's logits at least its
        top_k-th largest replaced by the exact ones, in place. By the C++ op where it runs (one
        pass a row, where torch needs several; its float64 sums in its own fixed order), else
        (``use_op=False`` too) in torch."""
        if not y.shape[0]:
            return y
        w = self.exact.weight
        if w is None or w.dtype != torch.float32 or tuple(w.shape) != (self.out_features, self.in_features):
            raise QuasarError(f"the exact head needs float32 rows [{self.out_features}, {self.in_features}]")
        op = ext.refine_exact_rows_op() if use_op and op_applies(y, self.top_k) and w.is_contiguous() else None
        if op is not None:
            op(y, x2.contiguous(), w, self.top_k)
            return y
        return refine_in_torch(y, x2, self.top_k, self.exact_logits)

    def exact_logits(self, x2: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
        """The float head's logit of token cols[i] for input row rows[i]: the float32 products
        of two contiguous rows summed in float64 (one fixed order), rounded to float32."""
        out = torch.empty(rows.numel(), dtype=torch.float32)
        w = self.exact.weight
        for i in range(0, rows.numel(), _EXACT_PAIRS):
            r, c = rows[i:i + _EXACT_PAIRS], cols[i:i + _EXACT_PAIRS]
            # float32 products summed in float64: float64 temporaries of the products would cost
            # their allocation more than the arithmetic
            out[i:i + _EXACT_PAIRS] = torch.sum(w[c] * x2[r], dim=1, dtype=torch.float64).float()
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, top_k={self.top_k}, " \
               f"tied={self.tied}"
