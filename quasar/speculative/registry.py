"""Drafters by name, and the shared decoding options each one takes."""

from __future__ import annotations

from typing import Any

from quasar.errors import QuasarError
from quasar.speculative.drafters import Drafter, NgramDrafter, NoDrafter
from quasar.speculative.tree_drafter import TreeDrafter

_DRAFTERS: dict[str, type[Drafter]] = {"none": NoDrafter, "ngram": NgramDrafter, "tree": TreeDrafter}
# Not a drafter but a choice between two: `resolve_drafter`.
AUTO = "auto"


def check_drafter_name(name: str) -> None:
    """A QuasarError listing the known names unless `name` is a drafter or AUTO."""
    if name != AUTO:
        drafter_class(name)


def resolve_drafter(name: str, trees_pay: bool) -> str:
    """The drafter `name` stands for: AUTO is "tree" when trees pay on the verifier's measured
    step (quasar.defaults.DEFAULT_DRAFTER says where), else the chain "ngram"; any other name
    is itself."""
    check_drafter_name(name)
    if name != AUTO:
        return name
    return "tree" if trees_pay else "ngram"


def drafter_class(name: str) -> type[Drafter]:
    """The drafter class called ``name``; a QuasarError lists the known ones."""
    cls = _DRAFTERS.get(name)
    if cls is None:
        known = ", ".join(sorted([*_DRAFTERS, AUTO]))
        raise QuasarError(f"unknown drafter {name!r}; known drafters: {known}", param="drafter")
    return cls


def drafter_options(name: str, *, ngram_min: int, ngram_max: int, draft_budget: int) -> dict[str, Any]:
    """The constructor options of drafter ``name`` from the API's option names."""
    if name == "ngram":
        return {"n_min": ngram_min, "n_max": ngram_max}
    if name == "tree":
        return {"budget": draft_budget, "n_min": ngram_min, "n_max": ngram_max}
    return {}


def make_drafter(name: str, **opts: Any) -> Drafter:
    """Build a drafter by name, turning bad names and options into a QuasarError."""
    cls = drafter_class(name)
    try:
        return cls(**opts)
    except TypeError as exc:
        raise QuasarError(f"bad options for drafter {name!r}: {exc}", param="drafter") from exc
