"""jaxspec.serve.guard.Guard over real HTTP (a uvicorn server in a thread serving a tiny FastAPI app;
no model, no JAX): API key, Host check, CORS, content type, body limits, and a slow upload that
must not stall other requests. Plus `jaxspec serve`'s listen / flag checks, made before any model
is loaded.
"""
import asyncio
import contextlib
import http.client
import json
import select
import socket
import time

import openai
import pytest
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect

from jaxspec import cli
from jaxspec.serve.guard import Guard
from support.serve_cli import serve_fails, memory_of  # noqa: F401
from support.serve_inproc import serving

KEY = "test-key-123"
LIMIT = 64 * 1024


def inner_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "me"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.body()
        except ClientDisconnect:  # the slow uploads' clients leave mid-body: nothing to answer
            return None
        return {"length": len(body)}

    return app


@contextlib.contextmanager
def running(**guard_kw):
    """A uvicorn server of Guard(inner_app(), ...) on a free loopback port; yields the port."""
    guard_kw.setdefault("api_key", KEY)
    guard_kw.setdefault("max_body_bytes", LIMIT)
    guard_kw.setdefault("bound_host", "127.0.0.1")
    with serving(Guard(inner_app(), **guard_kw)) as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def port():
    with running() as p:
        yield p


@pytest.fixture(scope="module")
def cors_port():
    with running(allow_origins=("http://a.example",)) as p:
        yield p


def request(port, method, path, body=None, headers=None):
    """(status, headers dict lowercased, parsed JSON or raw bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
        try:
            data = json.loads(data)
        except ValueError:
            pass
        return r.status, hdrs, data
    finally:
        conn.close()


AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}


def assert_error(data, code):
    err = data["error"]
    assert err["type"] == "invalid_request_error" and err["param"] is None and err["code"] == code, data
    assert err["message"] and "\n" not in err["message"]


def raw(port, head: bytes, timeout=5) -> bytes:
    """Send raw request bytes, return the whole answer (the server closes or answers once)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        return read_response(s)


def read_response(s) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


# ---- API key ----------------------------------------------------------------------------------
def test_api_key(port):
    status, hdrs, data = request(port, "GET", "/v1/models")
    assert status == 401 and hdrs["www-authenticate"] == "Bearer"
    assert_error(data, "invalid_api_key")
    status, hdrs, data = request(port, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401 and hdrs["www-authenticate"] == "Bearer"
    assert_error(data, "invalid_api_key")
    assert request(port, "GET", "/v1/models", headers=AUTH)[0] == 200
    assert request(port, "GET", "/health")[2] == {"status": "ok"}


def test_api_key_with_the_openai_client(port):
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=10).models.list()
    models = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=10).models.list()
    assert [m.id for m in models.data] == ["m"]


def test_no_api_key_leaves_v1_open():
    with running(api_key=None) as p:
        assert request(p, "GET", "/v1/models")[0] == 200


# ---- content type -----------------------------------------------------------------------------
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_non_json_bodies_are_415(port, ctype):
    headers = dict(AUTH, **({"Content-Type": ctype} if ctype else {}))
    status, _, data = request(port, "POST", "/v1/completions", body=b"a=1", headers=headers)
    assert status == 415
    assert_error(data, "unsupported_media_type")
    assert (ctype or "none") in data["error"]["message"]


def test_json_body_passes(port):
    body = json.dumps({"prompt": "hi"}).encode()
    for ctype in ("application/json", "Application/JSON; charset=utf-8"):
        status, _, data = request(port, "POST", "/v1/completions", body=body,
                                  headers=dict(AUTH, **{"Content-Type": ctype}))
        assert (status, data) == (200, {"length": len(body)})


# ---- Host header ------------------------------------------------------------------------------
def test_foreign_host_is_400(port):
    for host in ("evil.example:8000", "evil.example", "127.0.0.1.evil.example", "[::2]:80"):
        status, _, data = request(port, "GET", "/health", headers={"Host": host})
        assert status == 400, host
        assert_error(data, "invalid_host")
        assert "invalid Host header" in data["error"]["message"]
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", "[::1]:8000", "LOCALHOST"):
        assert request(port, "GET", "/health", headers={"Host": host})[0] == 200, host


def test_missing_host_on_http11_is_400(port):
    assert status_of(raw(port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")) == 400
    assert status_of(raw(port, b"GET /health HTTP/1.0\r\n\r\n")) == 200


def test_a_wildcard_bind_keeps_a_host_allow_list():
    """Bound to every interface (which includes loopback), a name rebound to 127.0.0.1 is still
    refused; the machine's own names, any address literal and --allowed-host names are served."""
    with running(bound_host="0.0.0.0", allowed_hosts=("api.example",)) as p:
        for host in ("127.0.0.1.rebind.attacker.example", "evil.example:8000", "localhost.evil.example",
                     "api.example.evil.example"):
            status, _, data = request(p, "GET", "/health", headers={"Host": host})
            assert status == 400, host
            assert_error(data, "invalid_host")
            assert "--allowed-host" in data["error"]["message"]
        for host in ("localhost", f"127.0.0.1:{p}", "10.1.2.3:8000", "[fe80::1]:80", socket.gethostname(),
                     "api.example:443", "API.example"):
            assert request(p, "GET", "/health", headers={"Host": host})[0] == 200, host


# ---- CORS -------------------------------------------------------------------------------------
PREFLIGHT = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def cors_headers(hdrs):
    return {k: v for k, v in hdrs.items() if k.startswith("access-control-")}


def test_cors_off_by_default(port):
    status, hdrs, _ = request(port, "GET", "/v1/models", headers=dict(AUTH, Origin="http://a.example"))
    assert status == 200 and not cors_headers(hdrs)
    status, hdrs, data = request(port, "OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert status == 403 and not cors_headers(hdrs)
    assert_error(data, "cors_disabled")
    assert "--allow-origin" in data["error"]["message"]


def test_cors_allowed_origin(cors_port):
    status, hdrs, _ = request(cors_port, "GET", "/v1/models", headers=dict(AUTH, Origin="http://a.example"))
    assert status == 200 and hdrs["access-control-allow-origin"] == "http://a.example" and "Origin" in hdrs["vary"]
    status, hdrs, _ = request(cors_port, "GET", "/v1/models", headers=dict(AUTH, Origin="http://b.example"))
    assert status == 200 and not cors_headers(hdrs)
    # a refusal still carries the header, so the page can read why
    status, hdrs, _ = request(cors_port, "GET", "/v1/models", headers={"Origin": "http://a.example"})
    assert status == 401 and hdrs["access-control-allow-origin"] == "http://a.example"

    status, hdrs, _ = request(cors_port, "OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert status == 204 and hdrs["access-control-allow-origin"] == "http://a.example"
    assert [m.strip() for m in hdrs["access-control-allow-methods"].split(",")] == ["GET", "POST", "OPTIONS"]
    assert {h.strip().lower() for h in hdrs["access-control-allow-headers"].split(",")} == {"authorization",
                                                                                            "content-type"}
    status, hdrs, data = request(cors_port, "OPTIONS", "/v1/completions",
                                 headers=dict(PREFLIGHT, Origin="http://b.example"))
    assert status == 403 and not cors_headers(hdrs)
    assert_error(data, "origin_not_allowed")


def test_cors_star():
    with running(allow_origins=("*",)) as p:
        status, hdrs, _ = request(p, "GET", "/health", headers={"Origin": "http://x.example"})
        assert status == 200 and hdrs["access-control-allow-origin"] == "http://x.example"


# ---- body size --------------------------------------------------------------------------------
def test_declared_length_over_the_limit_is_413_unread(port):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n").encode()
    t0 = time.monotonic()
    answer = raw(port, head)  # no body sent: the answer must come without it
    assert status_of(answer) == 413 and time.monotonic() - t0 < 2
    assert_error(json.loads(answer.partition(b"\r\n\r\n")[2]), "request_too_large")


def test_body_at_the_limit_passes(port):
    body = b"[" + b" " * (LIMIT - 2) + b"]"
    status, _, data = request(port, "POST", "/v1/completions", body=body, headers=JSON)
    assert (status, data) == (200, {"length": LIMIT})


def chunked_head(port) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()


def test_chunked_body_growing_past_the_limit_is_413(port):
    chunk = b"%x\r\n%s\r\n" % (4096, b" " * 4096)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(chunked_head(port))
        sent = 0
        for _ in range(4 * LIMIT // 4096):
            s.sendall(chunk)
            sent += 4096
            if select.select([s], [], [], 0.05)[0]:  # answered: stop sending
                break
        answer = read_response(s)
    assert status_of(answer) == 413, answer[:200]
    assert LIMIT < sent < 2 * LIMIT
    assert_error(json.loads(answer.partition(b"\r\n\r\n")[2]), "request_too_large")


def test_invalid_content_length_is_400(port):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 12abc\r\n\r\n").encode()
    assert status_of(raw(port, head)) == 400  # uvicorn's parser or the guard: either way, one 400


def call_guard(headers, http_version="1.1"):
    """The guard called directly (no server): the messages it sent; the app must not be reached."""
    sent = []

    async def app(scope, receive, send):
        raise AssertionError("the app was reached")

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    guard = Guard(app, api_key=None, max_body_bytes=LIMIT, bound_host="127.0.0.1")
    scope = {"type": "http", "http_version": http_version, "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json"), *headers]}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def test_guard_refuses_what_uvicorn_refuses_too():
    # uvicorn's parser refuses these before the app sees them; the guard must not rely on that
    status, data = call_guard([(b"host", b"localhost"), (b"content-length", b"-5")])
    assert status == 400
    assert_error(data, "invalid_content_length")
    status, data = call_guard([(b"content-length", b"2")])  # HTTP/1.1 without a Host
    assert status == 400
    assert_error(data, "invalid_host")


def health_time(port) -> float:
    t0 = time.monotonic()
    assert request(port, "GET", "/health")[0] == 200
    return time.monotonic() - t0


def test_slow_uploads_do_not_stall_the_server():
    with running(max_body_bytes=128 << 20) as p:
        declared = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", p), timeout=5) as a, \
                socket.create_connection(("127.0.0.1", p), timeout=5) as b:
            a.sendall(declared)
            b.sendall(chunked_head(p))
            for i in range(5):  # bytes trickling in on both, /health prompt all along
                a.sendall(b" " * 1000)
                b.sendall(b"%x\r\n%s\r\n" % (1000, b" " * 1000))
                time.sleep(0.1)
                assert health_time(p) < 1.0
            b.sendall(b"0\r\n\r\n")  # the chunked one finishes: its whole body was read
            assert json.loads(read_response(b).partition(b"\r\n\r\n")[2]) == {"length": 5000}


# ---- `jaxspec serve`: bad listen addresses and flags, found before loading --------------------
@pytest.fixture
def no_loading(monkeypatch):
    def reached(*a, **kw):
        raise AssertionError("a model was about to be loaded")
    monkeypatch.setattr(cli, "_resolve_dirs", reached)
    monkeypatch.setattr(cli, "_load_pair", reached)


def test_serve_port_out_of_range(capsys, no_loading):
    assert "65535" in serve_fails(capsys, "--port", "70000")
    serve_fails(capsys, "--port", "0")


def test_serve_host_does_not_resolve(capsys, no_loading):
    assert "no-such-host.invalid" in serve_fails(capsys, "--host", "no-such-host.invalid")


def test_serve_port_in_use(capsys, no_loading):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        err = serve_fails(capsys, "--port", str(busy))
    assert f"cannot listen on 127.0.0.1:{busy}" in err


@pytest.mark.parametrize("argv", [("--rounds-per-chunk", "1000000"), ("--rounds-per-chunk", "0"),
                                  ("--max-body-bytes", "10"), ("--max-queue", "0"), ("--prefill-chunk", "8"),
                                  ("--prefill-chunk", "40"), ("--kv-positions", "0"), ("--kv-positions", "8"),
                                  ("--kv-positions", "40"), ("--kv-positions", str(1 << 27))])
def test_serve_flags_out_of_range(capsys, no_loading, argv):
    assert argv[0] in serve_fails(capsys, *argv)


@pytest.mark.parametrize("origin", ["a.example", "http://a.example/path", "http://a.example:port", "http://a:99999",
                                    "http://a:0"])
def test_serve_bad_origin(capsys, no_loading, origin):
    assert "--allow-origin" in serve_fails(capsys, "--allow-origin", origin)


@pytest.mark.parametrize("name", ["api.example:443", "http://api.example", "a b", ""])
def test_serve_bad_allowed_host(capsys, no_loading, name):
    assert "--allowed-host" in serve_fails(capsys, "--allowed-host", name)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_bind_needs_a_key(capsys, no_loading, monkeypatch, host):
    monkeypatch.delenv("JAXSPEC_API_KEY", raising=False)
    err = serve_fails(capsys, "--host", host)
    assert "--api-key" in err and "--insecure-no-key" in err
    # with a key, or the explicit opt-out, the flags pass (the address itself is checked next)
    for extra in (["--api-key", "k3y"], ["--insecure-no-key"]):
        args = cli.build_parser().parse_args(["serve", "--host", host, *extra])
        cli._check_bind(args)


@pytest.mark.parametrize("key", ["abc \r", " abc", "a b", "abc\n", "ab\tc"])
def test_an_api_key_with_whitespace_is_refused(capsys, no_loading, monkeypatch, key):
    monkeypatch.delenv("JAXSPEC_API_KEY", raising=False)
    assert "--api-key" in serve_fails(capsys, "--api-key", key)
    monkeypatch.setenv("JAXSPEC_API_KEY", key)  # a key file read with its newline
    assert "JAXSPEC_API_KEY" in serve_fails(capsys)


def test_max_connections_must_stay_below_the_fd_limit(capsys, no_loading, monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4096))
    err = serve_fails(capsys, "--max-connections", "1000")
    assert "--max-connections 1000" in err and "1024" in err
    args = cli.build_parser().parse_args(["serve"])
    assert cli._max_connections(args) < 1024 - 64  # the default fits under the limit


def test_max_batch_is_checked_against_memory(capsys, monkeypatch):
    """Before loading: the batch's KV cache and logits against the device's memory (here made 1 GiB)."""
    port = memory_of(monkeypatch, 1 << 30, "test memory")
    err = serve_fails(capsys, "--max-batch", "4096", "--port", port)
    assert "--max-batch 4096" in err and "test memory" in err and "lower --max-batch" in err
    assert cli.main(["serve", "--max-batch", "1", "--port", port]) == 1  # fits: it goes on to load
    assert "a model was about to be loaded" in capsys.readouterr().err
