"""The SwiGLU MLP, ``down(silu(gate(x)) * up(x))``: every dense family's, and each expert of a
mixture-of-experts layer (quasar.models.moe)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from quasar.models.config import ModelConfig


class MLP(nn.Module):
    """`cfg`'s MLP, `intermediate` wide (default: the config's) with biases where the config
    has them, unless `bias` says otherwise (experts have none)."""

    def __init__(self, cfg: ModelConfig, intermediate: int | None = None, bias: bool | None = None):
        super().__init__()
        h, i = cfg.hidden_size, intermediate or cfg.intermediate_size
        bias = cfg.mlp_bias if bias is None else bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
