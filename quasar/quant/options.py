"""How a model is quantized: the options of the W8A8 pipeline, their defaults and checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quasar.errors import QuasarError
from quasar.quant.calibrate import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from quasar.quant.int8 import BACKEND_NAMES
from quasar.quant.numerics import ACT_BITS

DEFAULT_ALPHA: float | str = "auto"
DEFAULT_LM_HEAD = "int8"
DEFAULT_SMOOTH_O_DOWN = True
DEFAULT_ROTATE = True
DEFAULT_GPTQ = True
# Bits of the MLP down projection's activations (weights stay int8; see quasar.quant.int8):
# its inputs, silu(gate) * up, are the hardest for per-token int8 (ARCHITECTURE.md, "15-bit
# activations for the MLP down projections").
DEFAULT_DOWN_ACT_BITS = 15
LM_HEAD_CHOICES = ("int8", "float")
# What calibrates layer i + 1: the outputs of layer i once quantized (what the quantized
# model will really feed it, as GPTQ does), or of the float layer (the same statistics as
# calibrating the whole float model at once; the reference the tests compare against).
PROPAGATE_CHOICES = ("quantized", "float")


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


def check_options(alpha: float | str, lm_head: str, backend: str,
                  down_act_bits: int = DEFAULT_DOWN_ACT_BITS) -> float | str:
    if down_act_bits not in ACT_BITS:
        raise QuasarError(f"down_act_bits must be one of {', '.join(map(str, ACT_BITS))}, got {down_act_bits!r}")
    if lm_head not in LM_HEAD_CHOICES:
        raise QuasarError(f"lm_head must be one of {', '.join(LM_HEAD_CHOICES)}, got {lm_head!r}")
    if backend not in BACKEND_NAMES:
        raise QuasarError(f"unknown int8 backend {backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return parse_alpha(alpha)


@dataclass(frozen=True)
class QuantOptions:
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

    def checked(self) -> "QuantOptions":
        """These options with alpha parsed; a QuasarError names a bad one."""
        alpha = check_options(self.alpha, self.lm_head, self.backend, self.down_act_bits)
        if self.samples < 1 or self.seq_len < 2:
            raise QuasarError(f"need samples >= 1 and seq_len >= 2, got {self.samples} and {self.seq_len}")
        if self.propagate not in PROPAGATE_CHOICES:
            raise QuasarError(f"propagate must be one of {', '.join(PROPAGATE_CHOICES)}, got {self.propagate!r}")
        return dataclasses.replace(self, alpha=alpha)

    @property
    def int8_head(self) -> bool:
        return self.lm_head == "int8"
