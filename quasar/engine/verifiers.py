"""The float model's shallower verifier, `pruned:F`, and what a verifier's step reads.

Each verifier is its own Transformer (its own KV cache, quasar.engine.engine); `pruned:F`
shares the float model's weights, `w8a8` is an int8 copy of the same module tree
(quasar.engine.w8a8_verifier), `w4a8` one with 4-bit layers where the model's file has them
(quasar.engine.w4a8_verifier), `w4a8-small` the same with fewer bytes a step and less
fidelity (quasar.quant.w4a8_layouts).
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from quasar.models.llama import Transformer
from quasar.models.moe import sparse_blocks
from quasar.runtime.step_cost import expected_experts


def kept_layers(n_layers: int, fraction: float) -> list[int]:
    """Indices of `fraction` of the layers spread evenly, first and last always kept."""
    n_keep = min(n_layers, max(2, round(fraction * n_layers)))
    if n_keep >= n_layers:
        return list(range(n_layers))
    return sorted({round(i * (n_layers - 1) / (n_keep - 1)) for i in range(n_keep)})


def pruned_model(model: Transformer, fraction: float) -> Transformer:
    """A shallower model sharing the kept layers' weights (the paper's negative control)."""
    keep = kept_layers(len(model.model.layers), fraction)
    pruned = copy.copy(model)  # shallow: shares embeddings, norm, lm_head
    pruned._modules = dict(model._modules)
    body = copy.copy(model.model)
    body._modules = dict(model.model._modules)
    body.layers = nn.ModuleList(model.model.layers[i] for i in keep)
    pruned.model = body
    pruned.config = dataclasses.replace(model.config, num_layers=len(keep), layer_ids=keep)
    pruned.cache = None
    return pruned


def model_bytes(model: nn.Module, rows: int | None = None) -> int:
    """Bytes of weights one forward reads: everything but the embedding table (one row of
    it is read), with a tied lm_head counted once. A mixture-of-experts step of `rows` rows
    reads only the experts its rows reach: expected_experts of each sparse layer's (exactly
    top-k for one row; uniform routing beyond); rows None: every expert."""
    seen, total = set(), 0
    # modules read a few rows a step, not whole (a RefinedHead's int8 head): like the embedding
    unread = tuple(f"{n}." for n, m in model.named_modules() if not getattr(m, "streamed", True))
    # 4- and 6-bit layers stream their packing, not their stored form (a Q6_K value a byte)
    packed = {n: m for n, m in model.named_modules() if hasattr(m, "step_bytes")}
    total += sum(m.step_bytes() for m in packed.values())
    for name, t in model.state_dict().items():
        owner, _, part = name.rpartition(".")
        if name.startswith(("model.embed_tokens.", *unread)) or t.data_ptr() in seen or \
                (owner in packed and part != "bias"):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    if rows is None:
        return total
    for block in sparse_blocks(model):
        n = len(block.experts)
        expert = model_bytes(block.experts) / n
        total -= round(expert * (n - expected_experts(n, block.top_k, rows)))
    return total
