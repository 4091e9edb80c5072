"""The benchmark's shipped tasks: prompts built from the data packages' sets.

``task_prompts(task, n)`` gives ``n`` prompts of a task, spread evenly over its data set
(deterministic): code (HumanEval, raw completion), summarization (XSum), qa (MMLU
questions), math (ASDiv) and chat (multi-turn conversations that refer back to earlier
turns, as real chats do and as n-gram drafting expects).
"""

from __future__ import annotations

from typing import Any, Sequence

from quasar.data.datasets import ASDivItem, XSumItem, load_asdiv, load_humaneval, load_mmlu, load_xsum
from quasar.data.user_files import PromptItem
from quasar.errors import QuasarError

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
