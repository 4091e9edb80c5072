"""Which modules a config's family is built of: the model, one decoder layer, the final norm
and the embedding lookup, for code that builds a model or a part of one (loading, the
layer-by-layer quantizer). Llama, Mistral and Qwen are quasar.models.llama; Gemma 3 is
quasar.models.gemma3."""

from __future__ import annotations

from torch import Tensor, nn

from quasar.models.config import ModelConfig
from quasar.models.gemma3 import Gemma3DecoderLayer, Gemma3Transformer, GemmaRMSNorm, embedding_scale
from quasar.models.llama import DecoderLayer, RMSNorm, Transformer


def is_gemma3(cfg: ModelConfig) -> bool:
    return cfg.model_type == "gemma3_text"


def transformer(cfg: ModelConfig) -> Transformer:
    """The family's model for `cfg` (build it under ``torch.device("meta")`` to fill it later)."""
    return Gemma3Transformer(cfg) if is_gemma3(cfg) else Transformer(cfg)


def decoder_layer(cfg: ModelConfig, index: int) -> nn.Module:
    """Source layer `index` of the family (layers differ by index: Gemma's slide or not, a MoE's may be dense)."""
    return Gemma3DecoderLayer(cfg, index) if is_gemma3(cfg) else DecoderLayer(cfg, index)


def final_norm(cfg: ModelConfig) -> RMSNorm:
    return (GemmaRMSNorm if is_gemma3(cfg) else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)


def embed(cfg: ModelConfig, table: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` of the embedding `table` as the first layer receives them."""
    return table[ids] * embedding_scale(table) if is_gemma3(cfg) else table[ids]
