"""OpenAI request validation and response shapes, without pydantic models.

Requests are checked by hand so every error names the offending field (`param`) the way
OpenAI does, and comes back as `{"error": {"message", "type", "param", "code"}}` with
status 400. Unknown fields are ignored (clients send many); known fields of the wrong
type, and features this server does not implement (tools, penalties, ...), are rejected
rather than silently dropped. Quasar's own fields (`drafter`, `verifier`, `num_draft`,
`ngram_min`, `ngram_max`, `adaptive`, `draft_budget`, `top_k`) are accepted as extras.

This module is where a request's fields are checked: JSON types and OpenAI's own limits
here, the ranges of the decoding options by building them (`DraftOptions`,
`SamplingOptions`, then `request_plan`), whose one-line messages are the CLI's and
`LLM`'s too.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from quasar.engine.plan import DecodePlan
from quasar.engine.spec import VerifierSpec
from quasar.errors import QuasarError
from quasar.speculative.logprobs import MAX_TOP_LOGPROBS
from quasar.speculative.options import DecodeOptions, DraftOptions, SamplingOptions

MAX_STOP = 16
MAX_N = 16  # choices per request; decoded one after another, so each costs a full generation
MAX_TEMPERATURE = 2.0  # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions endpoint
# Deepest nesting a request body may have. Real requests need about 6 levels (messages ->
# message -> content parts -> part); the bound keeps everything that walks a body (json's
# own parser, error messages that re-serialise a value) far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# Seeds seed and seed + i (choice i) must fit torch's generator; negative ones are refused
# rather than wrapped.
MAX_SEED = 2**63 - MAX_N
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ApiError(Exception):
    """An error answered to the client in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 ApiError."""
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the interpreter's recursion limit
        raise _too_deep() from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request ({e}). The body must be "
                            "a JSON object, sent with Content-Type: application/json.",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, got {_type_name(body)}.",
                       code="invalid_json")
    if _depth_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    bad = _lone_surrogate_at(body)
    if bad is not None:
        raise ApiError(400, f"'{bad}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                            "which is not text.", param=bad, code="invalid_value")
    return body


def _too_deep() -> ApiError:
    return ApiError(400, f"The JSON body of your request is nested more than {MAX_JSON_DEPTH} levels deep.",
                    code="invalid_json")


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests arrays/objects more than `limit` levels deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _lone_surrogate_at(value: Any) -> str | None:
    """The path ("messages[0].content") of the first string, key or value, that JSON's
    \\uXXXX escapes made invalid Unicode; None when there is none (iterative)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:  # the path may hold the bad key itself: escape it
                return (path or "body").encode("utf-8", "backslashreplace").decode()[:200]
        elif isinstance(v, dict):
            for k, c in v.items():
                name = f"{path}.{k}" if path else k
                stack.append((k, name))
                stack.append((c, name))
        elif isinstance(v, list):
            stack.extend((c, f"{path}[{i}]") for i, c in enumerate(v))
    return None


# JSON's names for Python's types, bool before int (a bool is an int)
_TYPE_NAMES = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"),
               (dict, "an object"))


def _in_range(name: str, v, lo, hi, fmt: str):
    """`v` if it lies in [lo, hi] (None: unbounded), else an invalid-value error; `fmt` formats the numbers."""
    if lo is not None and v < lo:
        raise _invalid_value(name, f"{v:{fmt}} is less than the minimum of {lo:{fmt}}.")
    if hi is not None and v > hi:
        raise _invalid_value(name, f"{v:{fmt}} is greater than the maximum of {hi:{fmt}}.")
    return v


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return next((name for kind, name in _TYPE_NAMES if isinstance(v, kind)), type(v).__name__)


def _invalid_type(name: str, expected: str, value: Any) -> ApiError:
    return ApiError(400, f"Invalid type for '{name}': expected {expected}, but got {_type_name(value)} instead.",
                    param=name, code="invalid_type")


def _invalid_value(name: str, message: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{name}': {message}", param=name, code="invalid_value")


class _Fields:
    """Typed access to a JSON object's fields; null counts as absent."""

    def __init__(self, body: dict):
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def string(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        v = self.body.get(name)
        if v is None:
            if required:
                raise ApiError(400, f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
            return default
        if not isinstance(v, str):
            raise _invalid_type(name, "a string", v)
        return v

    def boolean(self, name: str, default: bool | None = None) -> bool | None:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _invalid_type(name, "a boolean", v)
        return v

    def integer(self, name: str, default: int | None = None, lo: int | None = None,
                hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise _invalid_type(name, "an integer", v)
        return _in_range(name, v, lo, hi, "")

    def number(self, name: str, default: float | None = None, lo: float | None = None,
               hi: float | None = None) -> float | None:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _invalid_type(name, "a number", v)
        v = float(v)
        if not math.isfinite(v):
            raise _invalid_value(name, "must be a finite number.")
        return _in_range(name, v, lo, hi, "g")

    def unsupported(self, name: str, ok) -> None:
        """Reject `name` unless it is absent or `ok(value)` holds (the feature is not implemented)."""
        v = self.body.get(name)
        if v is not None and not ok(v):
            raise ApiError(400, f"'{name}' = {json.dumps(v)[:80]} is not supported by this server.", param=name,
                           code="unsupported_parameter")


@dataclass
class GenRequest:
    """A validated chat or completion request, in Quasar's terms."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_tokens: int | None = None
    sampling: SamplingOptions = field(default_factory=lambda: SamplingOptions(temperature=1.0))
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: int | None = None  # None: off; N: each token's logprob and N alternatives
    # Quasar extras: the server's defaults where the request sets none
    draft: DraftOptions = field(default_factory=DraftOptions)
    verifier: str | None = None  # as sent; the server's context checks it (ServerContext.check_verifier)


def _checked(build, *args, **kwargs):
    """`build(*args, **kwargs)`, its QuasarError (a bad option) as a 400 naming the field."""
    try:
        return build(*args, **kwargs)
    except QuasarError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None


def request_plan(llm, req: GenRequest, verifier: VerifierSpec, max_tokens: int) -> DecodePlan:
    """The request's `DecodePlan` on `llm` (`quasar.api.LLM.plan`) and `verifier` (checked
    already), its drafter resolved; a bad value is a 400."""
    options = _checked(DecodeOptions, max_new_tokens=max_tokens, sampling=req.sampling, stop=req.stop,
                       draft=req.draft, logprobs=req.logprobs)
    return _checked(llm.plan, options, verifier)


def _common(f: _Fields, req: GenRequest, draft: DraftOptions) -> GenRequest:
    req.sampling = _checked(SamplingOptions, temperature=f.number("temperature", 1.0, hi=MAX_TEMPERATURE),
                            top_k=f.integer("top_k", 0), top_p=f.number("top_p", 1.0), seed=f.integer("seed", None, 0, MAX_SEED))
    stop = f.body.get("stop")
    if isinstance(stop, str):
        req.stop = [stop]
    elif isinstance(stop, list):
        if not all(isinstance(s, str) for s in stop):
            raise _invalid_type("stop", "a string or an array of strings", stop)
        if len(stop) > MAX_STOP:
            raise _invalid_value("stop", f"at most {MAX_STOP} stop sequences are allowed.")
        req.stop = list(stop)
    elif stop is not None:
        raise _invalid_type("stop", "a string or an array of strings", stop)
    req.stream = f.boolean("stream", False)
    opts = f.body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _invalid_type("stream_options", "an object", opts)
        if not req.stream:
            raise _invalid_value("stream_options", "only allowed when 'stream' is true.")
        include = opts.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise _invalid_type("stream_options.include_usage", "a boolean", include)
        req.include_usage = bool(include)
    req.n = f.integer("n", 1, 1, MAX_N)
    f.unsupported("best_of", lambda v: v == req.n)  # choosing the best of more than n is not implemented
    for name in ("presence_penalty", "frequency_penalty"):
        f.number(name, 0.0, -2.0, 2.0)
        f.unsupported(name, lambda v: v == 0)
    f.unsupported("logit_bias", lambda v: v == {})
    f.string("user")
    # Quasar's extras
    req.verifier = f.string("verifier")
    req.draft = _checked(draft.replace, drafter=f.string("drafter"), num_draft=f.integer("num_draft"),
                         ngram_min=f.integer("ngram_min"), ngram_max=f.integer("ngram_max"),
                         draft_budget=f.integer("draft_budget"), adaptive=f.boolean("adaptive"))
    return req


def _message_content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is understood
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", "
                                    "\"text\": ...}) are supported.", param=f"messages[{i}].content",
                               code="invalid_value")
            texts.append(part["text"])
        return "".join(texts)
    raise _invalid_type(f"messages[{i}].content", "a string or an array of text parts", content)


def _required(body: dict, name: str):
    """The request's `name`, which it must have."""
    value = body.get(name)
    if value is None:
        raise ApiError(400, f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    return value


def parse_chat(body: dict, draft: DraftOptions) -> GenRequest:
    """A chat request; its draft options are `draft` (the server's defaults) where it sets none."""
    f = _Fields(body)
    req = GenRequest("chat", f.string("model"))
    messages = _required(body, "messages")
    if not isinstance(messages, list):
        raise _invalid_type("messages", "an array", messages)
    if not messages:
        raise _invalid_value("messages", "expected an array with at least one message.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _invalid_type(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _invalid_type(f"messages[{i}].role", "a string", role)
        if role not in CHAT_ROLES:
            raise _invalid_value(f"messages[{i}].role", f"{role!r} is not one of {sorted(CHAT_ROLES)}.")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": "system" if role == "developer" else role, "content": _message_content(i, content)})
    req.messages = out
    req.max_tokens = f.integer("max_completion_tokens", None, 1)
    if req.max_tokens is None:
        req.max_tokens = f.integer("max_tokens", None, 1)
    top = f.integer("top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if f.boolean("logprobs", False):
        req.logprobs = top or 0
    elif top is not None:
        raise _invalid_value("top_logprobs", "'logprobs' must be true when 'top_logprobs' is set.")
    f.unsupported("tools", lambda v: v == [])
    f.unsupported("functions", lambda v: v == [])
    f.unsupported("tool_choice", lambda v: v == "none")
    f.unsupported("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text")
    return _common(f, req, draft)


def parse_completion(body: dict, vocab_size: int, draft: DraftOptions) -> GenRequest:
    """A completion request over a vocabulary of `vocab_size`; draft options as `parse_chat`'s."""
    f = _Fields(body)
    req = GenRequest("completion", f.string("model"))
    prompt = _required(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _invalid_value("prompt", "the prompt must not be empty.")
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise _invalid_value("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}).")
        req.prompt_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "Only one prompt per request is supported; send the prompts as separate requests.",
                       param="prompt", code="unsupported_parameter")
    else:
        raise _invalid_type("prompt", "a string, an array of token ids, or an array with one of those", prompt)
    req.max_tokens = f.integer("max_tokens", None, 1)
    f.unsupported("echo", lambda v: v is False)
    req.logprobs = f.integer("logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    f.unsupported("suffix", lambda v: v == "")
    return _common(f, req, draft)


# --------------------------------------------------------------------------- responses

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens reused from the prompt cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(req: GenRequest, index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
    """One choice of a complete (not streamed) response."""
    if req.kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(req: GenRequest, rid: str, created: int, model: str, choices: list[dict], use: dict,
                        quasar: dict) -> dict:
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": "quasar",
            "choices": choices, "usage": use, "quasar": quasar}


def stream_chunk(req: GenRequest, rid: str, created: int, model: str, *, index: int = 0, text: str | None = None,
                 role: bool = False, finish_reason: str | None = None, logprobs: dict | None = None,
                 quasar: dict | None = None, use: dict | None = None, no_choices: bool = False) -> dict:
    if req.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    chunk = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": "quasar",
             "choices": [] if no_choices else [choice]}
    if use is not None:
        chunk["usage"] = use
    if quasar is not None:
        chunk["quasar"] = quasar
    return chunk


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
