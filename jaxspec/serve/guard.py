"""The HTTP guard in front of `jaxspec serve`: a plain ASGI middleware (no framework base class).

    app = Guard(server.app(), api_key=key, allow_origins=("http://localhost:3000",),
                max_body_bytes=1 << 20, bound_host="127.0.0.1")

For http requests, in this order (lifespan and websocket scopes pass through):
- Host: bound to a loopback address, only a loopback Host header (localhost, 127.0.0.1, ::1, the
  bound host) is served: a web page cannot reach the server through a name it rebound to 127.0.0.1.
  Bound to any other address (a wildcard 0.0.0.0 / :: included, which also listens on loopback),
  the machine's own names, any address literal (a rebound name is never one) and the
  `allowed_hosts` names are served; any other name is refused.
- CORS: off unless allow_origins names the page's origin (or "*"); preflights are answered here.
- Auth: with an api_key, /v1... needs `Authorization: Bearer <key>`; /health stays open.
- Content type: POST / PUT / PATCH bodies must be application/json (a page's form posts are not).
- Body size: a declared Content-Length over max_body_bytes is refused before reading; a chunked body
  is counted as the app reads it and cut off once it passes the limit.
Refusals are OpenAI-style JSON errors, one line each.

Below the app, `http_protocol(...)` is the uvicorn connection class `jaxspec serve` runs: a cap on
open connections (an idle one is closed to make room, else the new one gets a 503), and timeouts
for an idle connection, a request's headers and its body. `log_drop` writes one line per client
dropped, at most DROP_BURST lines per DROP_WINDOW_S seconds (the rest are counted in one line).
"""
from __future__ import annotations

import asyncio
import collections
import errno
import hmac
import ipaddress
import json
import logging
import socket
import time

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


def is_wildcard(host: str) -> bool:
    """True for an address that listens on every interface: 0.0.0.0, ::, or an empty host."""
    h = host.strip().strip("[]")
    if not h:
        return True
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        return False


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def machine_names() -> set[str]:
    """This machine's host names (short and fully qualified) and the addresses they resolve to,
    lowercased; what resolution fails to give is left out."""
    names = set()
    for get in (socket.gethostname, socket.getfqdn):
        try:
            names.add(get().lower().rstrip("."))
        except OSError:
            pass
    for n in list(names):
        try:
            names |= {info[4][0].lower() for info in socket.getaddrinfo(n, None)}
        except (OSError, UnicodeError):
            pass
    names.discard("")
    return names


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


SHOWN_CHARS = 60  # of a value a refusal echoes; a longer one is cut with a marker saying how long it was


def shown(value) -> str:
    """A value from the client as it was sent, for a refusal: its JSON text (`"1"` for the string,
    `1` for the number), cut visibly past SHOWN_CHARS characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON (a header's text is a str: always is)
        text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def error_json(message: str, *, code: str | None = None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object (the guard's refusals and the server's errors alike)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_body(message: str, code: str) -> bytes:
    return json.dumps(error_json(message, code=code)).encode()


class Guard:
    """ASGI middleware: `Guard(app, ...)` is itself an ASGI app. See the module docstring."""

    def __init__(self, app, *, api_key: str | None, allow_origins: tuple[str, ...] = (), max_body_bytes: int,
                 bound_host: str, allowed_hosts: tuple[str, ...] = ()):
        self.app = app
        self.api_key = api_key.encode() if api_key else None  # compared as bytes: any key, any header
        self.allow_origins = frozenset(allow_origins)
        self.max_body_bytes = int(max_body_bytes)
        self.loopback = is_loopback(bound_host)
        names = set(_LOOPBACK_NAMES) | {bound_host.strip("[]").lower()} | {h.lower() for h in allowed_hosts}
        if not self.loopback:  # reachable from other machines, under the machine's own names
            names |= machine_names()
        self.allowed_hosts = frozenset(names)

    def _host_allowed(self, name: str | None) -> bool:
        """A DNS rebinding attack needs a name: an address literal is only ever the server's own
        (served when the server listens beyond loopback)."""
        return name is not None and (name in self.allowed_hosts or (not self.loopback and _is_address(name)))

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
        hosts = headers.get("host", [])
        if not hosts:
            if scope.get("http_version", "1.1") != "1.0":
                return await refuse(400, "invalid Host header: none was sent", "invalid_host")
        elif len(hosts) > 1 or not self._host_allowed(_host_name(hosts[0])):
            sent = shown(hosts[0] if len(hosts) == 1 else ", ".join(hosts))
            which = ("this server, bound to a loopback address, answers only to localhost" if self.loopback else
                     "this server answers only to its machine's names and addresses")
            return await refuse(400, f"invalid Host header {sent}: {which} (--allowed-host NAME adds a "
                                     "name)", "invalid_host")

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
                return await refuse(400, f"invalid Content-Length {shown(length)}", "invalid_content_length")
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


# ---- connections ---------------------------------------------------------------------------------
DROP_BURST, DROP_WINDOW_S = 20, 10.0
# The listen backlog, which is also how many connections asyncio accepts in one go before any of
# them reaches `connection_made` (where the cap applies): up to a few batches of them are open
# past the cap for a moment, so the fd limit must leave room for them (cli.FD_RESERVE).
ACCEPT_BACKLOG = 64
_log = logging.getLogger("uvicorn.error")  # uvicorn's own log: configured by uvicorn, on stderr


class _DropLog:
    """One line per dropped client, at most DROP_BURST per DROP_WINDOW_S seconds: a flood of
    clients cannot flood the log (the lines left out are counted in the next window's first)."""

    def __init__(self):
        self.start, self.count, self.skipped = 0.0, 0, 0

    def __call__(self, client, why: str) -> None:
        now = time.monotonic()
        if now - self.start >= DROP_WINDOW_S:
            self._flush()
            self.start, self.count = now, 0
        if self.count < DROP_BURST:
            self.count += 1
            who = f"{client[0]}:{client[1]}" if client else "a client"
            _log.warning("jaxspec: dropped %s: %s", who, why)
            return
        if not self.skipped:  # the count is logged when the window ends, even if no drop follows
            try:
                asyncio.get_running_loop().call_later(self.start + DROP_WINDOW_S - now, self._flush)
            except RuntimeError:  # no loop in this thread: the next drop logs it
                pass
        self.skipped += 1

    def _flush(self) -> None:
        if self.skipped:
            _log.warning("jaxspec: %d more clients were dropped (not logged: at most %d lines per %g s)",
                         self.skipped, DROP_BURST, DROP_WINDOW_S)
            self.skipped = 0


log_drop = _DropLog()
DROPPED = "jaxspec.dropped"  # set in a request's ASGI scope once its drop is logged


def quiet_accept_errors(loop, context) -> None:
    """An asyncio exception handler: running out of descriptors (or memory) while accepting is one
    rate-limited line, not a traceback a second (asyncio pauses accepting for a second and retries)."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
        log_drop(None, f"{context.get('message', 'accept failed')}: {exc.strerror}")
        return
    loop.default_exception_handler(context)


def fd_limit() -> int | None:
    """The process's soft limit on open files (None where it cannot be read)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)
    except (ImportError, OSError, ValueError):
        return None


def _busy_response(cap: int) -> bytes:
    body = _error_body(f"the server has {cap} connections open (--max-connections): retry later", "too_many_connections")
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def http_protocol(*, max_connections: int, idle_timeout: float, header_timeout: float, body_timeout: float):
    """The uvicorn HTTP/1.1 connection class (`uvicorn.Config(http=...)`) with limits:

    - at most `max_connections` open: at the cap a new connection closes the connection idle the
      longest (connected or between requests, nothing received), else it is answered 503 and closed
      (keep the cap below the file-descriptor limit: accepting never fails then);
    - a connection idle for `idle_timeout` s is closed (uvicorn's keep-alive timeout covers only the
      time after a response; a connection that never sends was held forever);
    - a request's headers must arrive within `header_timeout` s of its first byte, its body within
      `body_timeout` s of its headers, else the connection is closed (slow clients cannot hold it).
    Each drop past the cap or a timeout is one log line (`log_drop`); an idle close is not logged."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    idle: collections.OrderedDict = collections.OrderedDict()  # connections idle now, the longest idle first
    busy = _busy_response(max_connections)

    class LimitedH11(H11Protocol):
        _refused = False
        _phase: str | None = None
        _timer = None

        def connection_made(self, transport):
            if len(self.connections) >= max_connections:
                victim = next(iter(idle), None)
                if victim is None:  # every connection is working on a request: refuse this one
                    self._refused = True
                    transport.write(busy)
                    transport.close()
                    peer = transport.get_extra_info("peername")
                    log_drop(peer[:2] if isinstance(peer, tuple) else None,
                             f"{max_connections} connections are open (--max-connections): answered 503")
                    return
                idle.pop(victim)
                log_drop(victim.client, f"idle while {max_connections} connections were open (--max-connections)")
                victim.transport.close()
            super().connection_made(transport)
            idle[self] = None
            # uvicorn arms its keep-alive timeout only after a response: arm it for the first request too
            self.timeout_keep_alive_task = self.loop.call_later(idle_timeout, self.timeout_keep_alive_handler)

        def connection_lost(self, exc):
            if self._refused:
                return
            idle.pop(self, None)
            self._set_phase(None)
            super().connection_lost(exc)

        def data_received(self, data):
            idle.pop(self, None)
            super().data_received(data)
            self._watch()

        def on_response_complete(self):
            super().on_response_complete()
            self._watch()

        def _watch(self):
            """Which deadline applies now: the headers', the body's, or none (handled by the app, or idle)."""
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._set_phase("body")
            elif state is h11.IDLE and self.conn.our_state is h11.IDLE:
                if self.conn.trailing_data[0]:
                    self._set_phase("headers")
                else:
                    self._set_phase(None)
                    idle[self] = None
            else:
                self._set_phase(None)

        def _set_phase(self, phase):
            if phase == self._phase:
                return  # the deadline runs from the phase's start, not the last byte
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase = phase
            if phase is not None:
                seconds = header_timeout if phase == "headers" else body_timeout
                self._timer = self.loop.call_later(seconds, self._expired, phase, seconds)

        def _expired(self, phase, seconds):
            self._timer = None
            if self._phase == phase and not self.transport.is_closing():
                flag = "--header-timeout" if phase == "headers" else "--body-timeout"
                log_drop(self.client, f"its request {phase} did not arrive within {seconds:g} s ({flag})")
                if phase == "body" and self.scope is not None:
                    self.scope[DROPPED] = True  # the app, told the client left, need not log it again
                self.transport.close()

    return LimitedH11
