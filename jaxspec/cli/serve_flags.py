"""`jaxspec serve`'s flags checked before anything loads: the key, the bind address, origins and hosts, the connection cap."""
from __future__ import annotations

import os
import re
from jaxspec.serve.config import RANGES as SERVE_KNOBS, ServeConfig
from jaxspec.serve.guard import ACCEPT_BACKLOG
from jaxspec.cli.common import UsageError, _SERVE_RANGES, _check_knobs, _check_ranges, _one_line


def _api_key(args) -> tuple[str | None, str]:
    """(the key or None, where it came from). An empty one (e.g. `JAXSPEC_API_KEY=`) means none;
    one with whitespace, a control or a non-ASCII character is refused, not stripped: a header
    line cannot carry it, so it would answer 401 to every client (a key file read with its newline)."""
    key, source = args.api_key, "--api-key"
    if key is None:
        key, source = os.environ.get("JAXSPEC_API_KEY"), "$JAXSPEC_API_KEY"
    if not key:
        return None, source
    bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if bad is not None:
        raise UsageError(f"{source} holds {key[bad]!r} at character {bad}: an API key must be printable ASCII without "
                         "spaces (a trailing newline or carriage return included)")
    return key, source


def _check_bind(args) -> None:
    """A wildcard address (0.0.0.0, ::) listens on every interface: refused without an API key
    unless --insecure-no-key says so."""
    from jaxspec.serve.guard import is_wildcard

    if is_wildcard(args.host) and _api_key(args)[0] is None and not args.insecure_no_key:
        raise UsageError(f"--host {args.host} listens on every interface: give an API key (--api-key KEY or "
                         "$JAXSPEC_API_KEY), or pass --insecure-no-key to serve anyone who can reach it")


# File descriptors kept beside --max-connections: the server's own (model files, JAX, logs: ~70 on
# CPU) and the connections asyncio accepts in batches before the cap closes them.
FD_RESERVE = 128 + 3 * ACCEPT_BACKLOG


DEFAULT_MAX_CONNECTIONS = 512


def _max_connections(args) -> int:
    """--max-connections, or the default, checked against the open-file limit: at the cap,
    accepting a connection must still find a descriptor."""
    from jaxspec.serve.guard import fd_limit

    limit = fd_limit()
    room = None if limit is None else limit - FD_RESERVE
    if args.max_connections is None:
        if room is not None and room < 1:
            raise UsageError(f"the open-file limit of {limit} (ulimit -n) leaves no room for connections: raise it")
        return DEFAULT_MAX_CONNECTIONS if room is None else min(DEFAULT_MAX_CONNECTIONS, room)
    if room is not None and args.max_connections > room:
        raise UsageError(f"--max-connections {args.max_connections} does not fit the open-file limit of {limit} "
                         f"(ulimit -n; {FD_RESERVE} are kept for the server and connections being accepted): at most {max(room, 0)}, or raise "
                         "ulimit -n")
    return args.max_connections


# "*" or scheme://host[:port] (a browser's Origin header: no path, no trailing slash)
_ORIGIN = re.compile(r"^(\*|[a-zA-Z][a-zA-Z0-9+.-]*://(\[[0-9a-fA-F:.]+\]|[^\s/:?#\[\]@]+)(:\d{1,5})?)$")


_HOST_NAME = re.compile(r"^([A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_][A-Za-z0-9_-]{0,62})*\.?|[0-9a-fA-F:.]+)$")


def _check_serve_flags(args) -> None:
    """UsageError (one line) for a serve flag out of range, a malformed --allow-origin, or an
    address that cannot be listened on. Checked here rather than by argparse, whose errors print
    the whole usage."""
    _check_ranges(args, _SERVE_RANGES)
    _check_knobs(args, SERVE_KNOBS)
    for o in args.allow_origin or ():
        m = _ORIGIN.match(o)
        if not m or (m.group(3) and not 1 <= int(m.group(3)[1:]) <= 65535):
            raise UsageError(f"--allow-origin {o!r}: expected '*' or scheme://host[:port] with a port in 1..65535, "
                             "e.g. http://localhost:3000")
    for h in args.allowed_host or ():
        if not _HOST_NAME.match(h):
            raise UsageError(f"--allowed-host {h!r}: expected a host name or address as a Host header names it, "
                             "without a scheme or port (e.g. api.example.com)")
    for flag, v in (("--idle-timeout", args.idle_timeout), ("--header-timeout", args.header_timeout),
                    ("--body-timeout", args.body_timeout)):
        if not 0 < v <= 3600:  # also NaN
            raise UsageError(f"{flag} {v}: expected seconds in (0, 3600]")
    _api_key(args)
    _check_bind(args)
    _max_connections(args)
    _check_listen(args.host, args.port)


def _serve_config(args) -> ServeConfig:
    """The server's knobs from their flags (checked by _check_serve_flags: each flag is a field)."""
    return ServeConfig(**{name: getattr(args, name) for name in SERVE_KNOBS},
                       prefix_cache=not getattr(args, "no_prefix_cache", False))


def _check_listen(host: str, port: int) -> None:
    """UsageError unless (host, port) resolves and can be bound now (not in use, an address of
    this machine); the socket is closed again at once."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host!r} does not resolve: {_one_line(e)}") from None
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no obstacle
            s.bind(addr)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or _one_line(e)}") from None


def _served_names(args, target_path: str) -> tuple[str, tuple[str, ...]]:
    """(the model id the server answers to, its aliases), before the weights cache swaps the path:
    --model-name; the default pair's name; the name the user gave a known model (--model
    gemma-3-270m, --pair gemma-3-270m), its file's name an alias (clients that named the file keep
    working); else the target path's last part, as given."""
    from jaxspec.models import gguf
    from jaxspec.pairs import NAMES

    if args.model_name:
        return args.model_name, ()
    if args.model is None and args.pair in (None, "default"):
        return "jaxspec-default-pair", ()
    path_name = os.path.basename(os.path.normpath(target_path))
    given = args.model if args.model is not None else args.pair
    if given in (*gguf.KNOWN, *NAMES) and not os.path.lexists(given) and given != path_name:
        return given, (path_name,)
    return path_name, ()
