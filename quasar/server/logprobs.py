"""OpenAI's `logprobs` objects, built from the decode loop's per-token entries.

Chat choices carry `{"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal"}`;
completion choices the legacy `{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}`, whose `top_logprobs` maps the N best tokens and always the chosen one (so
up to N + 1 entries, as OpenAI documents). Values are the verifier's raw log-softmax
(`quasar.speculative.logprobs`). A token's text is its own decoding, and `bytes` that
text's UTF-8: a token that ends inside a multi-byte character shows as U+FFFD.
`text_offset` counts characters of those token texts from the start of the completion.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from quasar.speculative.logprobs import TokenLogprob


def token_texts(tokenizer) -> Callable[[int], str]:
    """id -> the token's text (special tokens spelled out), cached: alternatives repeat a lot."""
    return lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))


class ChoiceLogprobs:
    """The logprobs of one choice, chunk by chunk (a completion's text offsets run on across chunks)."""

    def __init__(self, kind: str, text_of: Callable[[int], str]):
        self.kind, self.text_of = kind, text_of
        self.offset = 0  # characters of token text so far

    def format(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.kind == "chat" else self._completion(entries)

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.text_of(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        tokens = [self.text_of(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        tops = [{self.text_of(t): lp for t, lp in e.top} | {text: e.logprob} for text, e in zip(tokens, entries)]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}
