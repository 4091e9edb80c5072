"""Tokenizer, chat template and streaming detokenizer, read from a model directory.

Uses the `tokenizers` library and jinja2 directly (no transformers import), so loading a
cached model stays fast.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from quasar.errors import QuasarError

Messages = list[dict[str, str]]


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # older tokenizer_config.json stores AddedToken dicts
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise QuasarError(f"{model_dir}: no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise QuasarError(f"{path}: cannot read tokenizer ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if self.chat_template is None and jinja.is_file():
            self.chat_template = jinja.read_text()
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()))
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_ids: set[int] = set()
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_ids.add(self._tok.token_to_id(self.eos_token))
        self.vocab_size = self._tok.get_vocab_size()

    def add_eos_ids(self, ids) -> None:
        self.eos_ids.update(int(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        """Render messages with the model's chat template (a plain fallback without one)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise QuasarError(f"message {i} must be an object with string 'role' and 'content'")
        if not self.chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=None,
        )

    def encode_chat(self, messages: Messages) -> list[int]:
        # A template spells out its special tokens (do not add them twice); the plain fallback
        # spells none, so it takes the tokenizer's own (a BOS, which Gemma needs).
        return self.encode(self.render_chat(messages), add_special_tokens=not self.chat_template)


_TEMPLATES: dict[str, object] = {}


def _compile(source: str):
    if source not in _TEMPLATES:
        def raise_exception(message):
            raise QuasarError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        try:
            _TEMPLATES[source] = env.from_string(source)
        except TemplateError as e:
            raise QuasarError(f"invalid chat template: {e}") from None
    return _TEMPLATES[source]


class StreamDecoder:
    """Turns a growing list of token ids into text deltas, never splitting a character.

    Byte-level BPE can end a token in the middle of a UTF-8 sequence; the decoded text then
    ends with U+FFFD and is held back until the next token completes it. Each push decodes
    only the tokens since the last delta plus the ones before it (as context, so that
    tokenizers which treat a sequence's first token specially still join correctly), not
    the whole output: a long generation costs linear, not quadratic, decoding time.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: context already shown
        self.read_offset = 0  # ids before this have been turned into text

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        shown = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tok.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        # A tokenizer that rewrites text across token boundaries (space clean-up) can change
        # what was shown; a stream cannot take it back, so continue after the common part.
        start = len(shown) if text.startswith(shown) else len(os.path.commonprefix([shown, text]))
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[start:]
