"""How a model is quantized: the options of the sequential pipeline (W8A8, or W4A8 from a float
model), their defaults and checks."""

from __future__ import annotations

from dataclasses import dataclass

from quasar.errors import QuasarError
from quasar.quant.calibrate import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from quasar.runtime.w8a8 import BACKEND_NAMES
from quasar.runtime.w8a8_numerics import ACT_BITS
from quasar.quant.w4a8_layouts import check_layout

DEFAULT_ALPHA: float | str = "auto"
DEFAULT_LM_HEAD = "int8"
DEFAULT_SMOOTH_O_DOWN = True
DEFAULT_ROTATE = True
DEFAULT_GPTQ = True
# Bits of the MLP down projection's activations (weights stay int8; see quasar.runtime.w8a8):
# its inputs, silu(gate) * up, are the hardest for per-token int8 (ARCHITECTURE.md, "15-bit
# activations for the MLP down projections").
DEFAULT_DOWN_ACT_BITS = 15
LM_HEAD_CHOICES = ("int8", "float")
# What calibrates layer i + 1: the outputs of layer i once quantized (what the quantized
# model will really feed it, as GPTQ does), or of the float layer (the same statistics as
# calibrating the whole float model at once; the reference the tests compare against).
PROPAGATE_CHOICES = ("quantized", "float")
WEIGHT_BITS = (8, 4)


def parse_alpha(value: float | str) -> float | str:
    """'auto' or a number in [0, 1] (as float); anything else is a QuasarError."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = float(value)
        except ValueError:
            raise QuasarError(f"--alpha must be 'auto' or a number in [0, 1], got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise QuasarError(f"alpha must be 'auto' or a number in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class QuantOptions:
    """How a model is quantized, checked when built (a QuasarError names a bad option).

    The CLI and `LLM` build one; it reaches the quantizer as it is, its weight-changing
    fields are the verifier cache's key (`cache_key`) and what the checkpoint records
    (`recorded`). `calib` is the user's calibration text file (None: the built-in corpus),
    `backend` the int8 kernels to run with (it changes no weight)."""

    alpha: float | str = DEFAULT_ALPHA
    smooth_o_down: bool = DEFAULT_SMOOTH_O_DOWN
    lm_head: str = DEFAULT_LM_HEAD
    rotate: bool = DEFAULT_ROTATE
    gptq: bool = DEFAULT_GPTQ
    down_act_bits: int = DEFAULT_DOWN_ACT_BITS
    backend: str = "auto"
    samples: int = DEFAULT_SAMPLES
    seq_len: int = DEFAULT_SEQ_LEN
    propagate: str = "quantized"
    calib: str | None = None
    # 4: the decoder layers' linears become W4A8 (symmetric int4 groups, GPTQ-rounded when
    # gptq, not smoothed: the activations are quantized per group), the head as for 8
    weight_bits: int = 8
    # with weight_bits 4: which tensors stay int8 (quasar.quant.w4a8_layouts)
    w4_layout: str = "faithful"

    def __post_init__(self) -> None:
        if self.down_act_bits not in ACT_BITS:
            raise QuasarError(f"down_act_bits must be one of {', '.join(map(str, ACT_BITS))}, "
                              f"got {self.down_act_bits!r}")
        if self.lm_head not in LM_HEAD_CHOICES:
            raise QuasarError(f"lm_head must be one of {', '.join(LM_HEAD_CHOICES)}, got {self.lm_head!r}")
        if self.backend not in BACKEND_NAMES:
            raise QuasarError(f"unknown int8 backend {self.backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
        for name, lo in (("samples", 1), ("seq_len", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise QuasarError(f"{name} must be an integer >= {lo}, got {value!r}", param=name)
        if self.weight_bits not in WEIGHT_BITS:
            raise QuasarError(f"weight_bits must be one of {', '.join(map(str, WEIGHT_BITS))}, got {self.weight_bits!r}")
        check_layout(self.w4_layout)
        if self.propagate not in PROPAGATE_CHOICES:
            raise QuasarError(f"propagate must be one of {', '.join(PROPAGATE_CHOICES)}, got {self.propagate!r}")
        object.__setattr__(self, "alpha", parse_alpha(self.alpha))
        if self.calib is not None:
            object.__setattr__(self, "calib", str(self.calib))

    @property
    def int8_head(self) -> bool:
        return self.lm_head == "int8"

    def recorded(self) -> dict:
        """What the checkpoint's `quantization_config.quasar` says of how it was made."""
        return {"alpha": self.alpha, "smooth_o_down": bool(self.smooth_o_down), "lm_head": self.lm_head,
                "backend": self.backend, "gptq": bool(self.gptq), "down_act_bits": int(self.down_act_bits),
                "rotate": bool(self.rotate), "pipeline": "sequential", "propagate": self.propagate,
                **({"weight_bits": 4, "w4_layout": self.w4_layout} if self.weight_bits == 4 else {})}

    def cache_key(self, calib_digest: str | None) -> dict:
        """The fields that change the weights, as the verifier cache keys them (`calib_digest`:
        the calibration text's sha256, None for the built-in corpus). Spelled as before
        QuantOptions carried them, so existing cache entries are still found; `propagate`
        enters only when not the default, which the cache never built before."""
        key = {"alpha": self.alpha, "lm_head": self.lm_head, "smooth_o_down": bool(self.smooth_o_down),
               "calib": calib_digest, "samples": int(self.samples), "seq_len": int(self.seq_len),
               "rotate": bool(self.rotate), "gptq": bool(self.gptq), "down_act_bits": int(self.down_act_bits),
               "pipeline": "sequential"}  # entries of the earlier whole-model pipeline are not reused
        if self.propagate != "quantized":
            key["propagate"] = self.propagate
        if self.weight_bits != 8:
            key["weight_bits"] = self.weight_bits
            key["w4_layout"] = self.w4_layout
        return key
