"""A long summarization prompt for `quasar bench --prompts` (long-context benchmarks).

    python scripts/tools/make_long_prompt.py [--tokens 5300] [--model default] [--out long.jsonl]

Joins whole XSum test articles from the shipped data package, in order, while the text stays
under --tokens tokens of --model's tokenizer, and asks for a summary of them: a real
document of a length users paste, the same prompt on every machine. Writes one JSONL line
({"messages": [...], "category": "long", "id": ...}) atomically and prints the token count.
"""

from __future__ import annotations

import argparse
import json

from quasar.data.datasets import load_xsum
from quasar.errors import QuasarError
from quasar.fileio import write_atomic
from quasar.models.loader import load_model

INSTRUCTION = "\n\nSummarize the articles above in a few sentences."


def long_text(tokenizer, max_tokens: int) -> tuple[str, int]:
    """The longest prefix of whole XSum articles under max_tokens tokens, and its length."""
    parts: list[str] = []
    text, count = "", 0
    for item in load_xsum():
        candidate = "\n\n".join([*parts, item.document.strip()])
        n = len(tokenizer.encode(candidate))
        if n > max_tokens:
            break
        parts.append(item.document.strip())
        text, count = candidate, n
    if not parts:
        raise QuasarError(f"no XSum article fits in {max_tokens} tokens")
    return text, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=5300, help="most tokens of article text (default 5300)")
    ap.add_argument("--model", default="default", help="whose tokenizer counts the tokens")
    ap.add_argument("--out", default="long.jsonl")
    args = ap.parse_args()
    if args.tokens < 16:
        raise SystemExit("--tokens must be at least 16")
    text, count = long_text(load_model(args.model).tokenizer, args.tokens)
    line = {"messages": [{"role": "user", "content": text + INSTRUCTION}], "category": "long",
            "id": f"xsum-{count}"}
    write_atomic(args.out, json.dumps(line) + "\n")
    print(f"{args.out}: {count} tokens of articles")


if __name__ == "__main__":
    main()
