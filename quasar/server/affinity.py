"""The conversation a request belongs to, as Ray Serve's session id (no Ray import here).

Replicas keep state a conversation's next turn can use (the recycling tables of tree drafts,
n-gram statistics, any prefix cache), so its turns should reach one replica. Ray Serve's
router sees a request's headers, not its body: the key travels in Ray's own session header
(`x-session-id`, which Ray's proxy puts into the request's metadata), and the router
(quasar.server.ray_router.ConversationRouter) maps it to a replica.

The key is the header a client sends, else derived from the body by `ConversationKey`, an
ASGI middleware Ray runs inside its own HTTP proxy (Ray's proxy-callback hook,
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH = PROXY_CALLBACK): the request's `user`, else a
hash of its leading messages (those up to the first user message, which every later turn
repeats), else of the start of a completion prompt. It only names the conversation; the
replica is Ray's router's choice.
"""

from __future__ import annotations

import hashlib
import json

from starlette.middleware import Middleware

SESSION_HEADER = "x-session-id"  # Ray Serve's default RAY_SERVE_SESSION_ID_HEADER_KEY
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "quasar.server.affinity:proxy_middlewares"
KEYED_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_KEYED_BODY = 1 << 20  # a larger body is passed on without a key (the replica refuses it anyway)
PROMPT_LEAD = 512  # characters of a completion prompt that name its conversation


def _digest(kind: str, value) -> str:
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return f"{kind}-{hashlib.sha256(blob.encode('utf-8', 'surrogatepass')).hexdigest()[:20]}"


def conversation_key(body) -> str | None:
    """A chat or completion request's conversation key, or None when it names none."""
    if not isinstance(body, dict):
        return None
    user = body.get("user")
    if isinstance(user, str) and user:
        return _digest("user", user)
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        lead = []
        for message in messages:
            lead.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        return _digest("chat", lead)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return _digest("text", prompt[:PROMPT_LEAD])
    return None


def _header(scope, name: str) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.decode("latin-1").lower().replace("_", "-") == name:
            return value.decode("latin-1")
    return None


class ConversationKey:
    """Adds the session header to a chat or completion POST that has none, from its body.

    The body is read whole (up to MAX_KEYED_BODY) and handed on unchanged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in KEYED_PATHS \
                or _header(scope, SESSION_HEADER) is not None:
            return await self.app(scope, receive, send)
        messages, size, more = [], 0, True
        while more and size <= MAX_KEYED_BODY:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        key = None
        if not more and messages[-1]["type"] == "http.request":
            try:
                key = conversation_key(json.loads(b"".join(m.get("body", b"") for m in messages)))
            except (ValueError, UnicodeDecodeError):
                key = None  # the replica answers the bad body
        if key is not None:
            scope = dict(scope, headers=[*scope.get("headers", ()), (SESSION_HEADER.encode(), key.encode())])

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def proxy_middlewares() -> list:
    """Ray's proxy callback: the middlewares its HTTP proxy runs (PROXY_CALLBACK)."""
    return [Middleware(ConversationKey)]
