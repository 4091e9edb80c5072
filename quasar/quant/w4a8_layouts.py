"""The W4A8 verifier's layouts: which tensors stay wider than 4 bits.

- ``faithful`` (the default, ``--verifier w4a8``): a tensor the file keeps wider than 4 bits
  (Q5_K, Q6_K, Q8_0, F16: in a Q4_K_M file half of the value and down projections and the
  head) stays at its precision, never refitted to 4 bits: Q6_K as its own 6-bit blocks, the
  others int8 with 15-bit activations; and the head's likeliest
  logits are recomputed from the float weights (quasar.runtime.exact_head). A float model keeps
  the same tensors int8 that llama.cpp's Q4_K_M keeps in 6 bits (``keeps_wider``).
- ``small`` (``--verifier w4a8-small``): those tensors fitted to 4-bit groups and a 4-bit head
  refined by int8 (quasar.runtime.refined_head): fewer bytes a step, less faithful.
"""

from __future__ import annotations

from quasar.errors import QuasarError

FAITHFUL = "faithful"
SMALL = "small"
LAYOUTS = (FAITHFUL, SMALL)
# the verifier name of each layout
VERIFIER_NAMES = {FAITHFUL: "w4a8", SMALL: "w4a8-small"}


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise QuasarError(f"unknown W4A8 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def keeps_wider(name: str, layer: int, n_layers: int) -> bool:
    """Whether llama.cpp's Q4_K_M keeps decoder linear `name` (a Hugging Face name such as
    ``self_attn.v_proj``) of layer `layer` in 6 bits: the value and down projections of the
    first and last eighth of the layers and of every third layer between (its
    ``use_more_bits``)."""
    if not name.endswith(("self_attn.v_proj", "mlp.down_proj")):
        return False
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2
