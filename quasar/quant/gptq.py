"""GPTQ rounding: int8 weights chosen with error feedback, weighted by the inputs' X^T X.

Same format and scales as plain rounding (``numerics.quantize_weight``: symmetric int8 per
output channel; for the W4A8 verifier ``w4a8_numerics.quantize_weight_w4``: symmetric int4
in groups along the input); only the rounding of each weight changes, so that
||X W^T - X Q^T|| is small rather than ||W - Q||.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn
from tqdm import tqdm

from quasar.runtime.w8a8_numerics import quantize_weight
from quasar.runtime.w4a8_numerics import INT4_MAX, quantize_weight_w4

GPTQ_DAMP = 0.1  # of the mean diagonal of X^T X
_BLOCK = 128  # columns whose error feedback is applied as one matrix product
_ROWS = 16384  # output rows done at a time: a vocabulary-sized lm_head is never copied whole


def _upper_inverse(r: Tensor, leaf: int = 512) -> Tensor:
    """Inverse of upper triangular matrices r [B, n, n] by 2x2 blocks, mostly matrix
    products: inv([[A, B], [0, D]]) = [[inv(A), -inv(A) B inv(D)], [0, inv(D)]]. A third of
    the work of a triangular solve against the identity."""
    n = r.shape[-1]
    if n <= leaf:
        eye = torch.eye(n, dtype=r.dtype).expand_as(r)
        return torch.linalg.solve_triangular(r, eye, upper=True)
    k = n // 2
    a_inv, d_inv = _upper_inverse(r[:, :k, :k], leaf), _upper_inverse(r[:, k:, k:], leaf)
    out = torch.zeros_like(r)
    out[:, :k, :k], out[:, k:, k:] = a_inv, d_inv
    out[:, :k, k:] = -(a_inv @ r[:, :k, k:] @ d_inv)
    return out


def _inverse_cholesky(hessian: Tensor, damp: float) -> Tensor | None:
    """The upper triangular U with U^T U = H^-1 for the damped Hessians [B, in, in]
    (float32), or None when H is not positive definite even after damping.

    GPTQ's chol(inv(H)), upper, with one factorization and one triangular inverse instead
    of three factorizations: with J the order-reversing permutation, chol(J H J) = C gives
    H = R R^T for the upper R = J C J, so U = R^-1. float32 as in GPTQ's reference (the
    damping keeps it well conditioned); float64 if that fails.
    """
    h = hessian.detach().float().clone()
    diag = torch.diagonal(h, dim1=1, dim2=2)
    diag[diag <= 0] = 1.0  # inputs never seen: no error feedback through them
    diag += damp * diag.mean(dim=1, keepdim=True)
    for dtype in (torch.float32, torch.float64):
        c, info = torch.linalg.cholesky_ex(h.to(dtype).flip(1, 2))
        if bool((info == 0).all()):
            return _upper_inverse(c.flip(1, 2)).float()
    return None


def _round_rows(w: Tensor, scale: Tensor, u: Tensor, block: int, qmax: int = 127) -> Tensor:
    """GPTQ over the columns of w [B, rows, in] (modified in place) with factor u; int8 values
    in [-qmax, qmax]. ``scale`` [B, rows, in] is each weight's step (a per-row scale expanded
    along the columns, or a group's repeated over its columns)."""
    n = w.shape[2]
    q = torch.empty_like(w)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        wt = w[:, :, i1:i2].transpose(1, 2).contiguous()  # [B, cols, rows]: a column is a row
        st = scale[:, :, i1:i2].transpose(1, 2)
        inv = 1.0 / st  # once a block, not once a column
        qt = torch.empty_like(wt)
        err = torch.empty_like(wt)
        u1 = u[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col, s2 = wt[:, i:i + 1], st[:, i:i + 1]
            qi = torch.round(col * inv[:, i:i + 1]).clamp_(-qmax, qmax)
            qt[:, i:i + 1] = qi
            e = (col - qi * s2) / u1[:, i, i, None, None]
            err[:, i:i + 1] = e
            if i + 1 < i2 - i1:
                wt[:, i + 1:].baddbmm_(u1[:, i, i + 1:, None], e, alpha=-1)
        q[:, :, i1:i2] = qt.transpose(1, 2)
        if i2 < n:
            w[:, :, i2:].sub_(torch.bmm(err.transpose(1, 2), u[:, i1:i2, i2:]))
    return q.to(torch.int8)


@torch.no_grad()
def gptq_quantize(weight: Tensor, hessian: Tensor, damp: float = GPTQ_DAMP, block: int = _BLOCK,
                  group: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-output-channel symmetric int8 like ``quantize_weight`` (same scales), rounded by
    GPTQ for inputs with second moments ``hessian`` = X^T X. Returns (int8 [out, in],
    float32 [out, 1]). With ``group``: symmetric int4 in groups of ``group`` input columns
    like ``w4a8_numerics.quantize_weight_w4`` (the same float16 scales, taken from the
    weights before any error feedback), returning (int8 [out, in] in [-7, 7], float16
    [out, groups]).

    Batched: ``weight`` [B, out, in] with ``hessian`` [B, in, in] runs B independent
    problems at once. Output rows are independent given the Hessian, so they are done
    ``_ROWS`` at a time.
    """
    single = weight.dim() == 2
    w_all = weight[None] if single else weight
    n_batch, n_out, n_in = w_all.shape
    u = _inverse_cholesky(hessian[None] if single else hessian, damp)
    qs, scales = [], []
    for r1 in range(0, n_out, _ROWS):
        w = w_all[:, r1:r1 + _ROWS].detach().float().clone()
        if group is None:
            q_s = [quantize_weight(w[b]) for b in range(n_batch)]
            scale = torch.stack([s for _, s in q_s])  # [B, rows, 1]
            steps, qmax = scale.expand_as(w), 127
        else:
            q_s = [quantize_weight_w4(w[b], group) for b in range(n_batch)]
            scale = torch.stack([s for _, s in q_s])  # [B, rows, groups] float16
            steps, qmax = scale.float().repeat_interleave(group, dim=2)[:, :, :n_in], INT4_MAX
        qs.append(torch.stack([q for q, _ in q_s]) if u is None else _round_rows(w, steps, u, block, qmax))
        scales.append(scale)
        del w, steps
    q, scale = torch.cat(qs, dim=1), torch.cat(scales, dim=1)
    return (q[0], scale[0]) if single else (q, scale)


def gptq_weights(linears: dict[str, nn.Linear], owners: dict[str, str], hessians: dict[str, Tensor],
                 scales: dict[str, Tensor], progress: bool = False,
                 group: int | None = None) -> dict[str, tuple[Tensor, Tensor]]:
    """GPTQ-rounded (int8, scale) for the linears whose input owner has a Hessian (with
    ``group``: int4 groups and their float16 scales, see ``gptq_quantize``).

    Linears reading the same input (q, k, v; gate, up: the same ``owners`` entry) share it
    and are rounded as one matrix. The Hessians come from the unsmoothed inputs; smoothing
    divides the input by s (``scales[owner]``), so H becomes H / (s s^T).
    """
    by_owner: dict[str, list[str]] = {}
    for name in linears:
        owner = owners.get(name)
        if owner is not None and owner in hessians:
            by_owner.setdefault(owner, []).append(name)
    out = {}
    for owner, names in tqdm(by_owner.items(), desc="gptq", unit="matrix", file=sys.stderr,
                             disable=not progress, leave=False):
        h = hessians[owner]
        s = scales.get(owner)
        if s is not None:
            s = s.float()
            h = h / (s[:, None] * s[None, :])
        weights = [linears[n].weight.detach() for n in names]
        # one matrix (an lm_head) is read as it is: gptq_quantize widens a block of rows at a time
        w = weights[0] if len(weights) == 1 else torch.cat([x.float() for x in weights])
        q, scale = gptq_quantize(w, h, group=group)
        start = 0
        for n in names:
            rows = linears[n].out_features
            out[n] = (q[start:start + rows], scale[start:start + rows])
            start += rows
    return out
