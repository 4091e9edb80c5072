"""Verifier models built from the float model: `fp`, `w8a8`, `w4a8`, `pruned:F`.

Each verifier is its own Transformer (its own KV cache); `pruned:F` shares the float
model's weights, `w8a8` is an int8 copy of the same module tree, `w4a8` one with 4-bit
layers where the model's file has them (quasar.engine.w4a8_verifier), `w4a8-small` the same
with fewer bytes a step and less fidelity (quasar.quant.w4a8_layouts).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

from torch import nn

from quasar.errors import QuasarError
from quasar.models.llama import Transformer

VERIFIERS = ("fp", "w8a8", "w4a8", "w4a8-small", "pruned:F")
QUANTIZED = ("w8a8", "w4a8", "w4a8-small")  # built from the model file, never from the float model


def parse_verifier(name: str) -> tuple[str, float | None]:
    """'fp' -> ('fp', None); 'pruned:0.5' -> ('pruned', 0.5); anything else is an error."""
    if name == "fp" or name in QUANTIZED:
        return name, None
    if name.startswith("pruned:"):
        try:
            frac = float(name.split(":", 1)[1])
        except ValueError:
            frac = -1.0
        if not 0.0 < frac <= 1.0:
            raise QuasarError(f"pruned verifier needs a fraction in (0, 1], e.g. pruned:0.5; got {name!r}",
                              param="verifier")
        return "pruned", frac
    raise QuasarError(f"unknown verifier {name!r}; choose one of {', '.join(VERIFIERS)}", param="verifier")


def canonical_verifier(name: str) -> str:
    """The one spelling of verifier `name`: 'pruned:0.50', 'pruned:5e-1' -> 'pruned:0.5'.
    Verifiers are kept by name, so two spellings of one must not build two models."""
    kind, frac = parse_verifier(name)
    return kind if frac is None else f"pruned:{frac:.15g}"


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


def build_verifier(name: str, float_model: Callable[[], Transformer],
                   quantized: dict[str, Callable[[], Transformer]]) -> Transformer:
    """The verifier `name`; `float_model` is called only for the verifiers built from the
    float weights (fp, pruned:F), so a quantized verifier (`quantized[name]`, w8a8 and w4a8)
    never makes them load."""
    kind, frac = parse_verifier(name)
    if kind == "fp":
        return float_model()
    if kind == "pruned":
        return pruned_model(float_model(), frac)
    return quantized[kind]()


def model_bytes(model: Transformer) -> int:
    """Bytes of weights one forward reads: everything but the embedding table (one row of
    it is read), with a tied lm_head counted once."""
    seen, total = set(), 0
    # modules read a few rows a step, not whole (a RefinedHead's int8 head): like the embedding
    unread = tuple(f"{n}." for n, m in model.named_modules() if not getattr(m, "streamed", True))
    for name, t in model.state_dict().items():
        if name.startswith(("model.embed_tokens.", *unread)) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
