"""The HTTP guard in front of `jaxspec serve`: a plain ASGI middleware (no framework base class).

    app = Guard(server.app(), api_key=key, allow_origins=("http://localhost:3000",),
                max_body_bytes=1 << 20, bound_host="127.0.0.1")

For http requests, in this order (lifespan and websocket scopes pass through):
- Host: bound to a loopback address, only a loopback Host header (localhost, 127.0.0.1, ::1, the
  bound host) is served: a web page cannot reach the server through a name it rebound to 127.0.0.1.
- CORS: off unless allow_origins names the page's origin (or "*"); preflights are answered here.
- Auth: with an api_key, /v1... needs `Authorization: Bearer <key>`; /health stays open.
- Content type: POST / PUT / PATCH bodies must be application/json (a page's form posts are not).
- Body size: a declared Content-Length over max_body_bytes is refused before reading; a chunked body
  is counted as the app reads it and cut off once it passes the limit.
Refusals are OpenAI-style JSON errors, one line each.
"""
from __future__ import annotations

import hmac
import ipaddress
import json

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_BODY_METHODS = ("POST", "PUT", "PATCH")
_ALLOW_METHODS = b"GET, POST, OPTIONS"
_ALLOW_HEADERS = b"Authorization, Content-Type"


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (brackets allowed)."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str | None:
    """The name in a Host header, port stripped and lowercased; None when malformed."""
    value = value.strip().lower()
    if value.startswith("["):  # IPv6 literal: "[::1]" or "[::1]:8000"
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1:]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return name
    name, sep, port = value.partition(":")
    if sep and not port.isdigit():  # also a bare IPv6 address, which a Host header may not carry
        return None
    return name or None


def error_json(message: str, *, code: str | None = None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object (the guard's refusals and the server's errors alike)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_body(message: str, code: str) -> bytes:
    return json.dumps(error_json(message, code=code)).encode()


class Guard:
    """ASGI middleware: `Guard(app, ...)` is itself an ASGI app. See the module docstring."""

    def __init__(self, app, *, api_key: str | None, allow_origins: tuple[str, ...] = (), max_body_bytes: int,
                 bound_host: str):
        self.app = app
        self.api_key = api_key.encode() if api_key else None  # compared as bytes: any key, any header
        self.allow_origins = frozenset(allow_origins)
        self.max_body_bytes = int(max_body_bytes)
        self.allowed_hosts = (frozenset(_LOOPBACK_NAMES) | {bound_host.strip("[]").lower()}
                              if is_loopback(bound_host) else None)

    def _origin_allowed(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.allow_origins or origin in self.allow_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        headers: dict[str, list[str]] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.decode("latin-1").lower(), []).append(v.decode("latin-1"))

        def one(name: str) -> str | None:
            vals = headers.get(name)
            return vals[-1] if vals else None

        method = scope.get("method", "GET").upper()
        origin = one("origin")
        cors = self._origin_allowed(origin)
        # Without a Content-Length or Transfer-Encoding there is no body to leave unread.
        has_body = "transfer-encoding" in headers or (one("content-length") or "0").strip() != "0"

        async def refuse(status, message, code, extra=()):
            hdrs = [(b"content-type", b"application/json"), *extra]
            if has_body:  # the body is not read: close rather than read it to reuse the connection
                hdrs.append((b"connection", b"close"))
            if cors:  # lets the page read why it was refused
                hdrs += [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            body = _error_body(message, code)
            hdrs.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": status, "headers": hdrs})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        # Host first: a rebound page must learn nothing else about the server.
        if self.allowed_hosts is not None:
            hosts = headers.get("host", [])
            if not hosts:
                if scope.get("http_version", "1.1") != "1.0":
                    return await refuse(400, "invalid Host header: none was sent", "invalid_host")
            elif len(hosts) > 1 or _host_name(hosts[0]) not in self.allowed_hosts:
                shown = hosts[0] if len(hosts) == 1 else ", ".join(hosts)
                return await refuse(400, f"invalid Host header {shown!r}: this server, bound to a loopback "
                                         "address, answers only to localhost", "invalid_host")

        # Preflights carry no credentials, so they are answered before the key is asked for.
        if method == "OPTIONS" and "access-control-request-method" in headers:
            if not self.allow_origins:
                return await refuse(403, "cross-origin requests are off (start the server with --allow-origin "
                                         "ORIGIN to allow them)", "cors_disabled")
            if not cors:
                return await refuse(403, f"origin {origin!r} is not allowed (--allow-origin)", "origin_not_allowed")
            await send({"type": "http.response.start", "status": 204, "headers": [
                (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                (b"access-control-allow-methods", _ALLOW_METHODS),
                (b"access-control-allow-headers", _ALLOW_HEADERS), (b"access-control-max-age", b"600")]})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

        path = "/" + scope.get("path", "/").lstrip("/")  # "//v1/..." is /v1 too
        if self.api_key is not None and path.startswith("/v1"):
            auth = one("authorization") or ""
            scheme, _, token = auth.strip().partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key)
            if not ok:
                msg = ("invalid API key" if auth else
                       "missing API key: send the header 'Authorization: Bearer <key>'")
                return await refuse(401, msg, "invalid_api_key", [(b"www-authenticate", b"Bearer")])

        if method in _BODY_METHODS:
            ctype = one("content-type")
            if ctype is None or ctype.split(";", 1)[0].strip().lower() != "application/json":
                got = "none" if ctype is None else repr(ctype)
                return await refuse(415, f"unsupported Content-Type {got}: send application/json",
                                    "unsupported_media_type")

        length = one("content-length")
        if length is not None:
            try:
                if len(set(headers["content-length"])) > 1 or not length.strip().isdigit():
                    raise ValueError
                declared = int(length)
            except ValueError:
                return await refuse(400, f"invalid Content-Length {length!r}", "invalid_content_length")
            if declared > self.max_body_bytes:
                return await refuse(413, f"request body of {declared} bytes is over the limit of "
                                         f"{self.max_body_bytes} bytes", "request_too_large")

        await self._forward(scope, receive, send, refuse, origin if cors else None)

    async def _forward(self, scope, receive, send, refuse, cors_origin):
        """The app, with its body counted as it reads it and CORS headers added to its response."""
        started = False   # a response (the app's or ours) has begun
        answered = False  # we sent the 413: the app's own response is dropped
        cut = False       # the body was cut off: the app is told the client went away
        received = 0

        async def guarded_receive():
            nonlocal received, started, answered, cut
            if cut:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # Stop reading here: the app sees a client that went away, the client a 413
                    # (unless the app's response has begun: then it only ends early).
                    cut = True
                    if not started:
                        started = answered = True
                        await refuse(413, f"request body is over the limit of {self.max_body_bytes} bytes",
                                     "request_too_large")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if answered:
                return
            if message["type"] == "http.response.start":
                started = True
                if cors_origin is not None:
                    hdrs = [(k, v) for k, v in message.get("headers", ())
                            if k.lower() != b"access-control-allow-origin"]
                    hdrs += [(b"access-control-allow-origin", cors_origin.encode("latin-1")), (b"vary", b"Origin")]
                    message = {**message, "headers": hdrs}
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if not cut:
                raise
            # else: the app failed on the body we cut off (a "disconnect"), which is expected
