"""Who may use the server, checked before any route runs (`AccessMiddleware`).

- With an API key, every route but `/health` needs it (the API, `/metrics`, the docs, the
  playground page): `Authorization: Bearer KEY`, or HTTP Basic with the key as the password,
  which is how a browser opens the playground (it asks once, then sends it with the page's
  own requests; the page itself never stores it).
- Without a key, the `Host` header must name this machine's loopback (`localhost`,
  `127.0.0.1`, `[::1]`, any port) or a host of `allowed_hosts`: a web page whose name is
  rebound to 127.0.0.1 (DNS rebinding) sends its own name, so it cannot read replies.
- A POST body must be `application/json`. A page on another site can send a form or
  `text/plain` POST (or one with no type) without asking the server first; a JSON POST from
  it needs a CORS preflight, which this server never grants.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import json
from collections.abc import Iterable

from starlette.responses import JSONResponse

from quasar.server.openai_schema import ApiError

OPEN_PATHS = ("/health",)  # answered without the key: load balancers and the CLI probe it
BROWSER_PAGES = ("/", "/docs")  # a 401 here asks the browser for the key (HTTP Basic)
BASIC_REALM = 'Basic realm="quasar", charset="UTF-8"'


def host_name(host: str) -> str:
    """A Host header's (or --allowed-hosts entry's) name without port or IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def is_loopback(host: str) -> bool:
    name = host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class AccessPolicy:
    """The API key (None: none needed) and the extra host names a keyless server answers to."""

    def __init__(self, api_key: str | None = None, allowed_hosts: Iterable[str] = ()):
        self.api_key = api_key or None
        self.allowed_hosts = frozenset(host_name(h) for h in allowed_hosts if h.strip())

    def check(self, method: str, path: str, headers: dict[str, str]) -> None:
        """Raise the ApiError (400, 401, 415) a request deserves, if any."""
        if self.api_key is None:
            self._check_host(headers.get("host"))
        elif path not in OPEN_PATHS:
            self._check_key(headers.get("authorization", ""), basic=path in BROWSER_PAGES)
        if method == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                raise ApiError(415, f"The request body must be JSON, sent with Content-Type: application/json "
                                    f"(got {json.dumps(media or None)[:60]}).", code="unsupported_media_type")

    def _check_host(self, host: str | None) -> None:
        if host and (is_loopback(host) or host_name(host) in self.allowed_hosts):
            return
        raise ApiError(400, f"Host {json.dumps(host)[:80]} is not served here: this server answers to its loopback "
                            "names and the hosts given with --allowed-hosts.", code="invalid_host")

    def _check_key(self, header: str, basic: bool) -> None:
        # the challenge only on pages: a browser then asks for the key; API clients get none
        challenge = {"WWW-Authenticate": BASIC_REALM} if basic else {}
        if not header:
            raise ApiError(401, "You didn't provide an API key. Send it in an Authorization header: "
                                "'Authorization: Bearer YOUR_KEY'.", code="missing_api_key", headers=challenge)
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "basic":
            token = _basic_password(token)
        elif scheme.lower() != "bearer":
            token = None
        if token is None or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key", headers=challenge)


def _basic_password(token: str) -> str | None:
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.partition(":")[2]


class AccessMiddleware:
    """Applies an `AccessPolicy` to every HTTP request, before routing."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
            try:
                self.policy.check(scope.get("method", "GET"), scope.get("path", ""), headers)
            except ApiError as e:
                return await JSONResponse(e.body(), status_code=e.status, headers=e.headers)(scope, receive, send)
        return await self.app(scope, receive, send)
