"""The sparse (mixture-of-experts) MLP of Qwen2-MoE, Qwen3-MoE and Mixtral.

A router picks each token's top-k experts from a softmax over its logits (renormalized over
the chosen k where the config says so: Mixtral always, Qwen with `norm_topk_prob`); the
token's output is the weighted sum of those experts' SwiGLU MLPs, plus Qwen2-MoE's shared
expert scaled by a sigmoid gate. Module names follow Hugging Face (`mlp.gate`,
`mlp.experts.N.gate_proj`, `mlp.shared_expert`, `mlp.shared_expert_gate`), so quantizing swaps
each expert's `nn.Linear`s like any other; the router and the shared expert's gate are not
`nn.Linear`s and stay float (a flipped expert choice costs more than their few bytes save).

A forward over R rows runs each expert once, over every row routed to it (index_select, then
added into the output rows in ascending expert order), so a row's result is the same whatever
other rows share the step: the one-token computation of that row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from quasar.models.config import ModelConfig
from quasar.models.mlp import MLP


class Router(nn.Module):
    """A float linear map without bias: `weight` [outputs, hidden] (the router's logits, or
    the shared expert's one gate logit), computed a row at a time: a float GEMM over several
    rows may round otherwise than over one, and a flipped expert choice (or a last bit that an
    int8 expert's input quantization turns into a rounding flip) would make a row's result
    depend on the other rows of its step."""

    def __init__(self, hidden: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([F.linear(x[r:r + 1], self.weight) for r in range(x.shape[0])])


class SparseMoE(nn.Module):
    """Router, experts and the optional shared expert of one decoder layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(h, cfg.num_experts)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size, bias=False) for _ in range(cfg.num_experts))
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size, bias=False)
            self.shared_expert_gate = Router(h, 1)
        # The distinct experts the last forward ran (what a step of its rows read), ascending.
        self.last_experts: list[int] = []

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Per row of x [N, hidden]: the chosen experts' weights [N, k] (x's dtype) and ids [N, k]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat)
        out = torch.zeros_like(flat)
        self.last_experts = chosen.unique().tolist()  # sorted
        for e in self.last_experts:
            rows, rank = (chosen == e).nonzero(as_tuple=True)
            y = self.experts[e](flat.index_select(0, rows))
            # rows are distinct within an expert: a gather-add-scatter (index_add_ takes far
            # longer on the CPU for a few rows)
            out.index_put_((rows,), out.index_select(0, rows) + y * weights[rows, rank, None])
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)

    def readers(self) -> list[nn.Module]:
        """Everything that reads the block's input (a residual rotation folds into each)."""
        parts = [self.gate, *(m for e in self.experts for m in (e.gate_proj, e.up_proj))]
        if self.has_shared:
            parts += [self.shared_expert.gate_proj, self.shared_expert.up_proj, self.shared_expert_gate]
        return parts

    def writers(self) -> list[nn.Linear]:
        """The linears whose outputs add into the residual stream."""
        return [e.down_proj for e in self.experts] + ([self.shared_expert.down_proj] if self.has_shared else [])


def sparse_blocks(model: nn.Module) -> list[SparseMoE]:
    """The model's sparse MLP blocks, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def experts_touched(model: nn.Module) -> list[int]:
    """How many distinct experts each sparse layer ran in the model's last forward (step)."""
    return [len(block.last_experts) for block in sparse_blocks(model)]
