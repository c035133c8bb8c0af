"""What a request must be before any route sees it: the defence against web pages.

A server on 127.0.0.1 is reachable by every page the user's browser opens. A page can POST
to it (a "simple" cross-site request: `text/plain`, no preflight) and, through DNS
rebinding, read the answer under its own host name. So, as Ollama does:
- `Host` must be a loopback name or the address the server is bound to (a server bound to
  all addresses needs an API key, which a page does not have, and takes any Host);
- a browser's `Origin` must be the server's own or one the user allowed (the
  `server.allowed_origins` setting, `thermocline serve --allow-origin`); only those get CORS
  headers, and a preflight from any other is refused;
- a POST must say `Content-Type: application/json` (a page cannot send that without a
  preflight, which the Origin rule refuses);
- the body limit holds while reading: a Content-Length over it is refused before a byte is
  read, and a chunked body is counted as it arrives.
Every refusal is an OpenAI-style error body.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Iterable
from urllib.parse import urlsplit

from .protocol import ApiError

MAX_BODY_BYTES = 16 * 1024 * 1024
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
CORS_HEADERS = [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"authorization, content-type"),
                (b"access-control-max-age", b"600")]


def _host_name(value: str) -> str:
    """`name:port`, `[v6]:port` or `name` -> the lower-case name."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value


def _is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def normalize_origin(origin: str) -> str:
    """`HTTP://Example.com:8080/` -> `http://example.com:8080` (how browsers send it)."""
    return origin.strip().rstrip("/").lower()


def check_origins(origins: Iterable[str]) -> list[str]:
    """The allowed origins as given by the user, each `scheme://host[:port]` or `*`."""
    out = []
    for origin in origins:
        origin = normalize_origin(str(origin))
        if not origin:
            continue
        if origin != "*" and ("://" not in origin or origin.split("://", 1)[1] in ("", "*")
                              or "/" in origin.split("://", 1)[1]):
            from engine.errors import UserError

            raise UserError(f"{origin[:100]!r} is not an origin: write it as scheme://host[:port], "
                            "e.g. http://localhost:3000 (or * for any)")
        out.append(origin)
    return out


class RequestGuard:
    """ASGI middleware in front of the application; see the module's docstring."""

    def __init__(self, app, *, bound_host: str = "127.0.0.1", allowed_origins: Iterable[str] = (),
                 max_body: int = MAX_BODY_BYTES):
        self.app = app
        self.bound = _host_name(bound_host) if bound_host not in WILDCARDS else ""
        self.any_host = bound_host in WILDCARDS
        self.allowed_origins = set(check_origins(allowed_origins))
        self.max_body = max_body

    def host_allowed(self, host: str) -> bool:
        name = _host_name(host)
        return self.any_host or _is_loopback_name(name) or (bool(self.bound) and name == self.bound)

    def origin_verdict(self, origin: str, port: int | None) -> str:
        """"own" (the server's own page), "allowed" (the user allowed it) or "refused"."""
        origin = normalize_origin(origin)
        try:
            parts = urlsplit(origin)
            origin_port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        except ValueError:
            return "refused"
        name = (parts.hostname or "").lower()
        if parts.scheme in ("http", "https") and name and origin_port == port and (
                _is_loopback_name(name) or name == self.bound):
            return "own"
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return "allowed"
        return "refused"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for key, value in scope.get("headers") or []:
            headers.setdefault(key.lower(), value.decode("latin-1"))
        refusal, cors = self._refusal(scope, headers)
        if refusal is not None:
            await _refuse(refusal, send, close=refusal.status == 413)
            return
        if scope["method"] == "OPTIONS" and cors:  # a preflight the user allowed
            await send({"type": "http.response.start", "status": 204, "headers": cors})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, self._counted(receive), self._with_cors(send, cors))

    def _refusal(self, scope, headers: dict) -> tuple[ApiError | None, list]:
        host = headers.get(b"host", "")
        if not self.host_allowed(host):
            return ApiError(403, f"the Host header {host[:80]!r} is not this server's: only loopback names "
                                 "or the address it listens on are answered (DNS rebinding protection)",
                            type="permission_error", code="host_not_allowed"), []
        cors = []
        origin = headers.get(b"origin")
        if origin is not None:
            server = scope.get("server") or (None, None)
            verdict = self.origin_verdict(origin, server[1])
            if verdict == "refused":
                return ApiError(403, f"requests from the web page {origin[:80]!r} are not allowed; allow its "
                                     "origin in the server settings or with --allow-origin",
                                type="permission_error", code="origin_not_allowed"), []
            if verdict == "allowed":
                cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
                cors += CORS_HEADERS
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
                return ApiError(415, f"the request body must be JSON sent as 'Content-Type: application/json', "
                                     f"not {kind[:60]!r}", code="unsupported_media_type"), cors
            length = headers.get(b"content-length")
            if length is not None and (not length.strip().isdigit() or int(length) > self.max_body):
                return ApiError(413, f"the request body is larger than {self.max_body} bytes",
                                code="request_too_large"), cors
        return None, cors

    def _counted(self, receive):
        seen = 0
        limit = self.max_body

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # the route's handler answers it (an ApiError) before more is read
                    raise ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
            return message
        return counted

    @staticmethod
    def _with_cors(send, cors: list):
        if not cors:
            return send

        async def send_cors(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers") or []) + cors)
            await send(message)
        return send_cors


async def _refuse(exc: ApiError, send, *, close: bool) -> None:
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the unread body stays unread: this connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
