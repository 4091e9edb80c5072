"""Model hyper-parameters for the Llama family, parsed from a Hugging Face config.json.

One dataclass covers Llama (incl. Llama-3 rope scaling), Mistral, Qwen2 (q/k/v bias) and
Qwen3 (q/k RMSNorm): they differ only in a few switches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quasar.errors import QuasarError

# architecture name in config.json -> (qkv bias default, o bias default, q/k norm)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Layers kept from the source model (pruned verifiers keep a subset); None = all.
    layer_ids: list[int] | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Parse a transformers config.json dict (v4 or v5 layout)."""
        model_type = _model_type(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope = dict(cfg.get("rope_parameters") or {})
            legacy_scaling = cfg.get("rope_scaling")
            if legacy_scaling:
                rope.update(legacy_scaling)
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in ("default", "linear", "llama3"):
                raise QuasarError(
                    f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)"
                )
            eos = cfg.get("eos_token_id")
            max_pos = int(cfg.get("max_position_embeddings", 4096))
            # Sliding-window attention is not implemented: cap the context at the window
            # so every position we compute is exact.
            window = cfg.get("sliding_window")
            if window and cfg.get("use_sliding_window", model_type == "mistral"):
                max_pos = min(max_pos, int(window))
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=max_pos,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling if rope_type != "default" else None,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
                layer_ids=cfg.get("quasar_layer_ids"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise QuasarError(f"config.json is missing or has a bad value for {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The config.json transformers reads for this model (v4-compatible keys)."""
        cfg: dict[str, Any] = {
            "architectures": [MODEL_TYPES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type in ("llama", "mistral"):
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = self.mlp_bias
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            cfg["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids
        return cfg


def _model_type(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    mt = cfg.get("model_type")
    if mt in MODEL_TYPES:
        return mt
    name = archs[0] if archs else mt
    supported = ", ".join(ARCHITECTURES)
    raise QuasarError(f"unsupported architecture {name!r}; supported: {supported}")
