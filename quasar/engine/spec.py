"""Which verifier a request asks for, as one typed value: `VerifierSpec`.

A verifier name ("fp", "w8a8", "w4a8", "w4a8-small", "pruned:0.5") is parsed once, where a
request enters (`LLM(...)`, `LLM.plan`, the server's context, the CLI), into a frozen
`VerifierSpec`; everything below takes the spec. `str(spec)` is the one spelling of it:
verifiers are kept by spec, so two spellings of one ("pruned:0.50", "pruned:5e-1") must
never build two models. No torch here: the CLI and the server check names before loading.
"""

from __future__ import annotations

from dataclasses import dataclass

from quasar.errors import QuasarError
from quasar.quant.w4a8_layouts import FAITHFUL, LAYOUTS, VERIFIER_NAMES

VERIFIERS = ("fp", "w8a8", "w4a8", "w4a8-small", "pruned:F")  # as messages and help list them
KINDS = ("fp", "w8a8", "w4a8", "pruned")
_W4A8_LAYOUTS = {name: layout for layout, name in VERIFIER_NAMES.items()}  # "w4a8-small" -> "small"


@dataclass(frozen=True)
class VerifierSpec:
    """A verifier: `kind` fp | w8a8 | w4a8 | pruned; a w4a8 verifier's `layout` (faithful or
    small, quasar.quant.w4a8_layouts); a pruned one's `fraction` of the layers, in (0, 1]."""

    kind: str
    layout: str | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise QuasarError(f"unknown verifier kind {self.kind!r}; choose one of {', '.join(KINDS)}",
                              param="verifier")
        if self.kind == "w4a8":
            object.__setattr__(self, "layout", self.layout or FAITHFUL)
            if self.layout not in LAYOUTS:
                raise QuasarError(f"unknown W4A8 layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}",
                                  param="verifier")
        elif self.layout is not None:
            raise QuasarError(f"only the w4a8 verifier has a layout, not {self.kind}", param="verifier")
        if self.kind == "pruned":
            frac = self.fraction
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac <= 1.0:
                raise QuasarError(f"pruned verifier needs a fraction in (0, 1], e.g. pruned:0.5; got {frac!r}",
                                  param="verifier")
            # Rounded to the digits its name shows: specs are equal exactly when their names are.
            object.__setattr__(self, "fraction", float(f"{frac:.15g}"))
        elif self.fraction is not None:
            raise QuasarError(f"only the pruned verifier has a fraction, not {self.kind}", param="verifier")

    @classmethod
    def parse(cls, name: str | VerifierSpec) -> VerifierSpec:
        """'fp' -> VerifierSpec('fp'); 'w4a8-small' -> VerifierSpec('w4a8', 'small');
        'pruned:0.5' -> VerifierSpec('pruned', fraction=0.5); a spec is returned as it is;
        anything else is a QuasarError (param "verifier")."""
        if isinstance(name, VerifierSpec):
            return name
        if not isinstance(name, str):
            raise QuasarError(f"verifier must be a name such as 'w8a8', got {name!r}", param="verifier")
        if name in ("fp", "w8a8"):
            return cls(name)
        if name in _W4A8_LAYOUTS:
            return cls("w4a8", layout=_W4A8_LAYOUTS[name])
        if name.startswith("pruned:"):
            try:
                frac = float(name.split(":", 1)[1])
            except ValueError:
                frac = -1.0
            if not 0.0 < frac <= 1.0:
                raise QuasarError(f"pruned verifier needs a fraction in (0, 1], e.g. pruned:0.5; got {name!r}",
                                  param="verifier")
            return cls("pruned", fraction=frac)
        raise QuasarError(f"unknown verifier {name!r}; choose one of {', '.join(VERIFIERS)}", param="verifier")

    def __str__(self) -> str:
        """The canonical name: 'fp', 'w8a8', 'w4a8', 'w4a8-small', 'pruned:0.5'."""
        if self.kind == "w4a8":
            return VERIFIER_NAMES[self.layout]
        return f"pruned:{self.fraction:.15g}" if self.kind == "pruned" else self.kind

    @property
    def name(self) -> str:
        return str(self)

    @property
    def quantized(self) -> bool:
        """Built from the model file (W8A8, W4A8), never from the float model."""
        return self.kind in ("w8a8", "w4a8")
