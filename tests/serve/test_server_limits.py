"""`jaxspec serve` against hostile clients (issue 51), on CPU over a tiny pair.

- A warmed server compiles nothing for a request that fits no batch slot: it is a 400 naming the
  slot's limit, and the server keeps serving (the compile log in /health is unchanged).
- Connections: past --max-connections a connection is refused (503, closed); idle sockets are
  closed after --idle-timeout; headers or a body that do not arrive in time are cut, one log line
  each; a client that leaves mid-body is one log line, not a traceback.
- Client input is a 400, never a 500: a lone surrogate in a prompt or a chat message, a logit_bias
  key of non-ASCII digits, chat message fields the server does not use; text longer than the
  context can hold is refused before the tokenizer sees it.
"""
import json
import socket
import time
import urllib.error

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.seeds import seeded_rng  # noqa: E402

CAP = 4  # --max-connections of the connection server


@pytest.fixture(scope="module")
def warmed(tiny_server):
    """One server for the module (conftest.py's tiny pair and batch settings): warmed up, with small
    connection limits."""
    return tiny_server("--max-connections", str(CAP), "--idle-timeout", "3", "--header-timeout", "1",
                       "--body-timeout", "1")


@pytest.fixture(scope="module")
def limited(warmed):
    return warmed


def complete(server, prompt, **kw):
    return server.client.completions.create(model="target", prompt=prompt, **kw)


# ---- no compile on the serving path after warm-up ----------------------------------------------
def test_a_request_that_fits_no_slot_is_refused_after_warm_up(warmed):
    compiled = warmed.health()["compiles"]
    with pytest.raises(openai.BadRequestError) as e:  # a slot's budget is half the context: 128
        complete(warmed, "def f(x):", max_tokens=200)
    err = e.value.body
    assert err["code"] == "exceeds_batch_slot" and err["param"] == "max_tokens", err
    assert "batch slot" in err["message"] and "128" in err["message"]
    assert warmed.health()["compiles"] == compiled  # refused before anything was built
    r = complete(warmed, "def f(x):", max_tokens=128)  # the largest budget that fits runs in the batch
    assert 1 <= r.usage.completion_tokens <= 128 and r.model_extra["jaxspec"]["batch_slots"] == 16
    assert warmed.health()["compiles"] == compiled


def test_a_lone_surrogate_is_a_400_over_http(warmed):
    # json.dumps escapes it as \\ud800 (the openai client cannot even encode it)
    status, reply = warmed.post("/v1/completions", json.dumps({"prompt": "def \ud800 f", "max_tokens": 2}).encode())
    assert status == 400 and reply["error"]["param"] == "prompt" and "surrogate" in reply["error"]["message"]
    assert complete(warmed, "def f(x):", max_tokens=2).choices[0].text is not None


# ---- connections -------------------------------------------------------------------------------
def _closed(sock, within=30.0) -> bytes:
    """Everything the server sends until it closes the socket (fails if it does not close it)."""
    sock.settimeout(within)
    got = b""
    while True:
        part = sock.recv(65536)
        if not part:
            return got
        got += part


def _log_lines(server) -> list[str]:
    return server.output().splitlines()


def test_connections_past_the_cap_are_refused(limited):
    # Each holds a request whose headers are still arriving: busy, not idle, so none can be evicted.
    held = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(CAP)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.2)  # all four connected on the server's side
        with socket.create_connection(("127.0.0.1", limited.port)) as extra:
            answer = _closed(extra, 10)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"--max-connections" in answer
    finally:
        for s in held:
            s.close()
    deadline = time.time() + 20
    while True:  # the held ones are gone: served again
        try:
            assert limited.health()["status"] == "ok"
            break
        except (urllib.error.URLError, OSError):
            assert time.time() < deadline
            time.sleep(0.1)


def test_idle_connections_are_evicted_for_new_ones(limited):
    """At the cap, a new connection closes the oldest idle one instead of being refused."""
    idle = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(CAP)]
    try:
        time.sleep(0.2)
        assert limited.health()["status"] == "ok"  # a fifth connection is served
        assert _closed(idle[0], 10) == b""  # the oldest idle one made room
    finally:
        for s in idle:
            s.close()


def test_idle_sockets_are_closed_after_the_idle_timeout(limited):
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        assert _closed(s) == b""  # --idle-timeout 3: nothing ever sent, closed by the server


def test_slow_headers_and_bodies_are_cut_with_one_line_each(limited):
    before = len(_log_lines(limited))
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")  # never finished
        _closed(s)
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        _closed(s)
    deadline = time.time() + 10
    while len(_log_lines(limited)) < before + 2 and time.time() < deadline:
        time.sleep(0.05)
    new = _log_lines(limited)[before:]
    assert len(new) == 2, new
    assert "header" in new[0] and "body" in new[1], new
    assert limited.health()["status"] == "ok"


def test_a_mid_body_disconnect_is_one_line_not_a_traceback(limited):
    before = len(_log_lines(limited))
    with socket.create_connection(("127.0.0.1", limited.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "' + b"a" * 100)
        time.sleep(0.3)  # the body is being read
    deadline = time.time() + 10
    while len(_log_lines(limited)) == before and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a traceback would follow its first line
    new = _log_lines(limited)[before:]
    assert len(new) == 1 and "Traceback" not in limited.output(), new
    assert limited.health()["status"] == "ok"


# ---- client input: 400s, before any compute (in process) -----------------------------------------
@pytest.fixture(scope="module")
def srv():
    from jaxspec import models
    from jaxspec.serve.app import Server
    from jaxspec.text.tokenizer import DEMO_CORPUS, Tokenizer, train_byte_bpe

    target, assistant = models.presets.tiny_pair(seed=0)
    tok = Tokenizer(train_byte_bpe([DEMO_CORPUS], vocab_size=target.config.vocab_size), eos_token_ids=(1,),
                    chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")
    s = Server(target, assistant, tok, model_name="m")
    yield s
    s.close()


def _refused(srv, body: dict, chat: bool):
    from jaxspec.serve.app import ApiError

    with pytest.raises(ApiError) as e:
        srv.job(json.dumps(body).encode(), chat)
    assert e.value.status == 400 and "\n" not in e.value.message
    return e.value


@pytest.mark.parametrize("chat,body,param,words", [
    (False, {"prompt": "ab\ud800c"}, "prompt", ("surrogate", "U+D800")),
    (False, {"prompt": ["x\udfff"]}, "prompt", ("surrogate", "U+DFFF")),
    (True, {"messages": [{"role": "user", "content": "hi \udc80"}]}, "messages", ("surrogate", "U+DC80")),
    (True, {"messages": [{"role": "us\ud800er", "content": "hi"}]}, "messages", ("surrogate",)),
    (False, {"prompt": "x", "logit_bias": {"\u00b2": 1}}, "logit_bias", ("token ids",)),
    (False, {"prompt": "x", "logit_bias": {"\uff11": 1}}, "logit_bias", ("token ids",)),  # fullwidth 1
    (True, {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages", ("'name'",)),
    (True, {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, "messages", ("'tool_calls'",)),
    (True, {"messages": [{"role": "user", "content": "hi", "x-extra": 1}]}, "messages", ("'x-extra'",)),
])
def test_client_input_is_a_400(srv, chat, body, param, words):
    e = _refused(srv, body, chat)
    assert e.param == param and all(w in e.message for w in words), e.message


def test_text_past_the_context_is_refused_before_tokenizing(srv, monkeypatch):
    """A prompt whose bytes no context-full of tokens can cover never reaches the tokenizer (the 1 MB
    prompts that froze the event loop); text under the bound still does."""
    calls = []
    real = srv.tok.encode

    def encode(text, **kw):
        calls.append(len(text))
        return real(text, **kw)
    monkeypatch.setattr(srv.tok, "encode", encode)
    big = "".join(seeded_rng().choice(list("abc def\n"), size=1 << 20))  # ~1 MB
    for chat, body in ((False, {"prompt": big}), (False, {"prompt": [big]}),
                       (True, {"messages": [{"role": "user", "content": big}]}),
                       (True, {"messages": [{"role": "user", "content": big[: len(big) // 2]},
                                            {"role": "user", "content": big[len(big) // 2:]}]})):
        e = _refused(srv, body, chat)
        assert e.code == "context_length_exceeded" and "bytes" in e.message, e.message
    assert calls == []
    srv.job(json.dumps({"prompt": big[:40]}).encode(), False)
    assert calls == [40]
