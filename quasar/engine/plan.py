"""`DecodePlan`: a request's checked decoding, the verifier it runs on (a `VerifierSpec`)
and its loop's options (quasar.speculative.options), built by `Engine.plan`."""

from __future__ import annotations

from dataclasses import dataclass

from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError
from quasar.speculative.options import DecodeOptions, DraftOptions


@dataclass(frozen=True)
class DecodePlan:
    """A request's checked decoding: the verifier it runs on and its loop's options, whose
    drafter is resolved (never "auto": results, stats and metrics name what ran)."""

    verifier_spec: VerifierSpec
    options: DecodeOptions

    def __post_init__(self) -> None:
        if not isinstance(self.verifier_spec, VerifierSpec):
            raise QuasarError(f"a plan's verifier must be a VerifierSpec, got {self.verifier_spec!r}",
                              param="verifier")

    @property
    def verifier(self) -> str:
        """The verifier's canonical name (what results, stats and metrics report)."""
        return str(self.verifier_spec)

    @property
    def draft(self) -> DraftOptions:
        return self.options.draft

    @property
    def drafter(self) -> str:
        return self.options.draft.drafter
