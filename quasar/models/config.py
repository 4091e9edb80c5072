"""Model hyper-parameters for the Llama family, parsed from a Hugging Face config.json.

One dataclass covers Llama (incl. Llama-3 rope scaling), Mistral, Qwen2 (q/k/v bias) and
Qwen3 (q/k RMSNorm): they differ only in a few switches.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from quasar.errors import QuasarError

# architecture name in config.json -> (qkv bias default, o bias default, q/k norm)
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # Phi-3 and Phi-4: fused qkv and gate_up, split at load (quasar.models.layouts)
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3_text",
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
    # Share of each head's dimensions RoPE rotates (Phi-4-mini: 0.75; the rest pass through).
    partial_rotary_factor: float = 1.0
    # Mixture-of-experts (quasar.models.moe): experts, experts per token, an expert's width,
    # whether the chosen experts' weights are renormalized, the shared expert's width (0:
    # none), and the (source model's) indices of the layers whose MLP is sparse.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: list[int] = field(default_factory=list)
    hidden_act: str = "silu"  # the MLP gate's activation: silu, or Gemma's tanh GELU
    # Gemma 3 (quasar.models.gemma3): sliding-window layers with a RoPE base of their own,
    # its own query scale and an optional final logit softcap.
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "sliding_attention" or "full_attention"
    rope_local_theta: float | None = None  # the sliding layers' RoPE base
    query_pre_attn_scalar: float | None = None  # attention scores are scaled by its -1/2 power
    final_logit_softcapping: float | None = None

    @property
    def sandwich_norms(self) -> bool:
        """Whether each sub-block's output is normed too before the residual add (Gemma 3)."""
        return self.model_type == "gemma3_text"

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` of this model has a sparse (mixture-of-experts) MLP."""
        source = self.layer_ids[index] if self.layer_ids else index
        return self.num_experts > 0 and source in self.moe_layers

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
            if rope_type in ("su", "yarn") and model_type == "phi3":  # Phi-3's old names of longrope
                rope_type = "longrope"
            if rope_type not in ("default", "linear", "llama3") and (rope_type, model_type) != ("longrope", "phi3"):
                raise QuasarError(
                    f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3; "
                    "longrope for Phi-3)"
                )
            if rope_type == "longrope":
                scaling["rope_type"] = rope_type
                scaling.setdefault("original_max_position_embeddings",
                                   cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
                scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
            eos = cfg.get("eos_token_id")
            max_pos = int(cfg.get("max_position_embeddings", 4096))
            # Sliding-window attention is not implemented: cap the context at the window
            # so every position we compute is exact.
            window = cfg.get("sliding_window")
            if window and cfg.get("use_sliding_window", model_type in ("mistral", "phi3")):
                max_pos = min(max_pos, int(window))
            parsed = cls(
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
                qkv_bias=bool(cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))
                or bool(cfg.get("attention_bias", False)),
                o_bias=model_type not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
                layer_ids=cfg.get("quasar_layer_ids"),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
                **_moe_fields(cfg, model_type),
            )
            return replace(parsed, **_gemma3_fields(cfg)) if model_type == "gemma3_text" else parsed
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
        if self.partial_rotary_factor != 1.0:
            cfg["partial_rotary_factor"] = self.partial_rotary_factor
        if self.num_experts:
            cfg.update(_moe_hf(self))
        if self.model_type in ("llama", "mistral"):
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = self.mlp_bias
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            cfg["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids
        if self.model_type == "gemma3_text":
            del cfg["hidden_act"]
            cfg.update(hidden_activation=self.hidden_act, layer_types=list(self.layer_types or []),
                       sliding_window=self.sliding_window, rope_local_base_freq=self.rope_local_theta,
                       query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar), attention_bias=self.qkv_bias,
                       final_logit_softcapping=self.final_logit_softcapping)
        return cfg


def _int_if_whole(x: float | None) -> float | int | None:
    """transformers types some float-valued keys int (Gemma 3's query_pre_attn_scalar)."""
    return int(x) if x is not None and float(x).is_integer() else x


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own keys: RoPE per attention kind (transformers v5's ``rope_parameters`` by
    layer type, or v4's rope_theta, rope_local_base_freq and rope_scaling), which layers slide
    (``layer_types``, else every sixth layer is global), GELU, the query scale, the softcap."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise QuasarError("Gemma attention logit softcapping is not supported (Gemma 3 has none)")
    if cfg.get("use_bidirectional_attention"):
        raise QuasarError("bidirectional Gemma 3 (an embedding model) is not supported")
    layers = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern") or 6)
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                            for i in range(layers)])
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise QuasarError(f"config.json: layer_types must name one of sliding_attention, full_attention "
                          f"for each of the {layers} layers")
    rope = dict(cfg.get("rope_parameters") or {})
    full = dict(rope.get("full_attention") or ({} if "sliding_attention" in rope else rope))
    full.update(cfg.get("rope_scaling") or {})
    local = dict(rope.get("sliding_attention") or {})
    theta = float(full.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
    kinds = {k: d.get("rope_type", d.get("type", "default")) for k, d in (("global", full), ("local", local))}
    if kinds["global"] not in ("default", "linear", "llama3") or kinds["local"] != "default":
        raise QuasarError(f"unsupported Gemma 3 rope scaling {kinds} (supported: default, linear; "
                          "the sliding layers' default)")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    softcap = cfg.get("final_logit_softcapping")
    return {
        "hidden_act": act, "qk_norm": True, "layer_types": types, "rope_theta": theta,
        "rope_scaling": full if kinds["global"] != "default" else None,
        "rope_local_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        "sliding_window": int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "final_logit_softcapping": float(softcap) if softcap is not None else None,
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 131_072)),
    }


def _moe_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (none for a dense model). Mixtral's
    `intermediate_size` is its experts' width and it always renormalizes the chosen weights;
    the Qwen MoE models make layer i sparse unless listed in `mlp_only_layers` or
    (i + 1) % `decoder_sparse_step` != 0."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if model_type not in ("qwen2_moe", "qwen3_moe", "mixtral") or experts == 0:
        return {}
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    mixtral = model_type == "mixtral"
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]),
        norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        moe_layers=[i for i in range(_source_layers(cfg)) if i not in dense and (i + 1) % step == 0],
    )


def _moe_hf(c: "ModelConfig") -> dict[str, Any]:
    """The config.json keys transformers reads for c's experts (the inverse of _moe_fields)."""
    if c.model_type == "mixtral":
        return {"num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok}
    return {"num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size, "norm_topk_prob": c.norm_topk_prob,
            "shared_expert_intermediate_size": c.shared_expert_intermediate_size, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(max([c.num_layers, *[i + 1 for i in c.layer_ids or []]]))
                                if i not in c.moe_layers]}


def _source_layers(cfg: dict[str, Any]) -> int:
    """Layers of the source model (a pruned verifier's config lists the ones it kept)."""
    return max([int(cfg["num_hidden_layers"]), *[i + 1 for i in cfg.get("quasar_layer_ids") or []]])


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
