"""The calibration corpus (exllamav2's standard texts) and its held-out tails.

Quantization calibrates on the head of each text; fidelity and perplexity are measured on
the disjoint tail, so they never score text the verifier was calibrated on.
"""

from __future__ import annotations

from typing import Literal, Sequence

from quasar.data.packages import calibration_dir
from quasar.errors import QuasarError

CALIBRATION_NAMES: tuple[str, ...] = ("wiki", "c4", "code", "technical", "multilingual", "tiny")

CalibrationPart = Literal["calibration", "heldout", "all"]


def split_calibration_text(text: str, holdout_fraction: float = 0.1) -> tuple[str, str]:
    """Split into (calibration head, held-out tail) at a line break near the cut.

    Perplexity/fidelity must be measured on text calibration never saw; cutting at a line
    (or word) boundary keeps both halves tokenising naturally. ``head + tail == text``.
    """
    if not 0.0 <= holdout_fraction < 1.0:
        raise QuasarError(f"holdout_fraction must be in [0, 1), got {holdout_fraction}")
    if holdout_fraction == 0.0 or not text:
        return text, ""
    cut = int(len(text) * (1.0 - holdout_fraction))
    window = max(1, len(text) // 100)  # look back at most 1% for a nice boundary
    for sep in ("\n", " "):
        pos = text.rfind(sep, max(0, cut - window), cut)
        if pos > 0:
            cut = pos + 1
            break
    return text[:cut], text[cut:]


def calibration_texts(
    names: Sequence[str] = CALIBRATION_NAMES,
    part: CalibrationPart = "calibration",
    holdout_fraction: float = 0.1,
) -> dict[str, str]:
    """Standard calibration texts by name; by default only the part calibration may see.

    ``part="heldout"`` gives the disjoint tails for perplexity/fidelity evaluation.
    """
    if part not in ("calibration", "heldout", "all"):
        raise QuasarError(f"part must be calibration, heldout or all, got {part!r}")
    folder = calibration_dir()
    out: dict[str, str] = {}
    for name in names:
        if name not in CALIBRATION_NAMES:
            raise QuasarError(
                f"unknown calibration text {name!r}: choose from {', '.join(CALIBRATION_NAMES)}"
            )
        text = (folder / f"{name}.utf8").read_text(encoding="utf-8")
        if part == "all":
            out[name] = text
        else:
            head, tail = split_calibration_text(text, holdout_fraction)
            out[name] = head if part == "calibration" else tail
    return out
