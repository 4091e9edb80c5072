"""The user's own files: text (for calibration or fidelity) and prompts (for bench).

Prompt files are JSONL with one of ``prompt`` (a string), ``messages`` (chat) or ``turns``
(a list of user turns; the first is used), plus optional ``category`` and ``id``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quasar.data.jsonl import iter_jsonl
from quasar.errors import QuasarError
from quasar.fileio import read_text


def read_text_records(path: str | Path) -> list[str]:
    """Documents of a user text file: .jsonl gives one ``text`` per line, else the file."""
    path = Path(path)
    if path.suffix.lower() == ".jsonl":
        texts = []
        for lineno, obj in iter_jsonl(path):
            text = obj.get("text")
            if not isinstance(text, str):
                raise QuasarError(f"{path}:{lineno}: expected a string field 'text'")
            if text.strip():
                texts.append(text)
    else:
        texts = [read_text(path)]
    if not any(t.strip() for t in texts):
        raise QuasarError(f"{path}: file is empty")
    return texts


def read_text_file(path: str | Path) -> str:
    """A user ``--calib``/``--text-file`` as one string (.jsonl documents joined by "\\n\\n")."""
    return "\n\n".join(read_text_records(path))


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
    items = [_prompt_from_obj(path, lineno, obj) for lineno, obj in iter_jsonl(path)]
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
