"""`jaxspec serve` end to end on CPU: the real server in a subprocess, talked to with the official
`openai` client. The embedded default pair: completions streamed and not, greedy text equal to the
CLI's, 8 concurrent streams each equal to its own run alone, every bad request answered with its
4xx error while the server keeps serving, a client that disconnects mid-stream dropped. A tiny pair
given a chat template: chat completions, streamed and not, equal to `jaxspec generate --chat`."""
import json
import re
import os
import shutil
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.cli_run import CACHE, run_cli  # noqa: E402
from support.server_proc import Running, concurrently  # noqa: F401


PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(", "def main():",
           "x = [", "return sorted(", "with open("]


@pytest.fixture(scope="module")
def server():
    s = Running("--max-batch", "4")  # 4 slots on any machine (a CPU's default is 1)
    yield s
    s.stop()


def start_line(server, name: str) -> str:
    """The server's "serving NAME on ..." line (printed just after uvicorn starts: waited for)."""
    deadline = time.time() + 30
    while True:
        lines = [line for line in server.output().splitlines() if f"serving {name!r}" in line]
        if lines or time.time() > deadline:
            assert lines, server.output()
            return lines[0]
        time.sleep(0.1)


def complete(server, prompt, max_tokens=24, **kw):
    r = server.client.completions.create(model="jaxspec-default-pair", prompt=prompt, max_tokens=max_tokens, **kw)
    return r


def streamed(server, prompt, max_tokens=24, **kw):
    chunks = list(server.client.completions.create(model="jaxspec-default-pair", prompt=prompt,
                                                   max_tokens=max_tokens, stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks), chunks


def test_completion_equals_the_cli_streamed_or_not(server):
    log = server.output()  # ready only after compiling what a short greedy request needs
    assert "compiling the first programs" in log and "serving 'jaxspec-default-pair'" in log, log
    # the library's lines (logging, shown by the CLI): the engine's warm-up, how long it took
    assert re.search(r"^jaxspec: batch engine warm-up took [\d.]+ s$", log, re.M), log
    assert re.search(r"^jaxspec: warm-up request took [\d.]+ s$", log, re.M), log  # the steps over every slot
    # the default pair has no chat template: the start line offers completions only (issue 50)
    start = start_line(server, "jaxspec-default-pair")
    assert "/v1/completions" in start and "/v1/chat/completions" not in start, start
    r = complete(server, PROMPTS[0])
    cli_run = run_cli("generate", PROMPTS[0], "--max-tokens", "24", "--json", "--compile-cache", CACHE)
    assert cli_run.returncode == 0, cli_run.stderr
    assert r.choices[0].text == json.loads(cli_run.stdout)["text"] and r.choices[0].text
    assert r.choices[0].finish_reason in ("length", "stop") and r.model == "jaxspec-default-pair"
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 24
    ext = r.model_extra["jaxspec"]
    assert ext["mode"] == "speculative" and ext["block_size"] == 4 and 0 <= ext["acceptance_rate"] <= 1
    text, chunks = streamed(server, PROMPTS[0])
    assert text == r.choices[0].text and len(chunks) > 2
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["jaxspec-default-pair"]


def test_stop_strings_cut_the_text(server):
    full = complete(server, PROMPTS[0]).choices[0].text
    stop = full.strip()[2:5]  # a string the greedy text contains, not at its start
    cut = full[:full.find(stop)]
    r = complete(server, PROMPTS[0], stop=[stop, "\u2603"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert streamed(server, PROMPTS[0], stop=stop)[0] == cut


def test_concurrent_streams_each_equal_their_run_alone(server):
    """8 streams at once on 4 slots (--max-batch 4): they decode together (the health
    endpoint sees several active at once), and each text equals the request's run alone."""
    lengths = [8 + 2 * i for i in range(len(PROMPTS))]
    alone = [complete(server, p, n) for p, n in zip(PROMPTS, lengths)]
    assert alone[0].model_extra["jaxspec"]["batch_slots"] == 4
    got, busiest = concurrently(server, [lambda i=i: streamed(server, PROMPTS[i], lengths[i])[0]
                                         for i in range(len(PROMPTS))])
    assert got == [r.choices[0].text for r in alone]
    assert 2 <= busiest <= 4


def test_sampling_follows_the_seed(server):
    kw = dict(max_tokens=16, temperature=1.0)
    seeded = [complete(server, PROMPTS[4], seed=7, **kw).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    unseeded = {complete(server, PROMPTS[4], **kw).choices[0].text for _ in range(3)}
    assert len(unseeded) > 1  # no seed: a random one per request


@pytest.mark.parametrize("body,status,match", [
    (b"{not json", 400, "not valid JSON"),
    (b'["a list"]', 400, "JSON object"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "does not exist"),
    (json.dumps({"prompt": 5}).encode(), 400, "'prompt' must be"),
    (json.dumps({"prompt": [1, 2, 99999]}).encode(), 400, "token ids must be in"),
    (json.dumps({"prompt": [5] * 300}).encode(), 400, "longer than the model's context"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "'max_tokens'"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "'temperature'"),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "'top_p'"),
    (json.dumps({"prompt": "x", "n": 17}).encode(), 400, "'n'"),
    (json.dumps({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "'stop'"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "'stream'"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, status, match):
    code, reply = server.post("/v1/completions", body)
    assert code == status and match in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    if status == 404:
        assert reply["error"]["code"] == "model_not_found"
    assert complete(server, PROMPTS[1], 8).choices[0].text


def test_chat_needs_a_chat_template(server):
    with pytest.raises(openai.BadRequestError, match="cannot chat"):
        server.client.chat.completions.create(model="jaxspec-default-pair",
                                              messages=[{"role": "user", "content": "hi"}])


# (A budget past a slot's, which ran alone, is refused after the warm-up: tests/serve/test_server_limits.py.)
@pytest.mark.parametrize("max_tokens", [120], ids=["batched"])
def test_a_client_that_disconnects_is_dropped(server, max_tokens):
    before = server.health()["dropped"]
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": max_tokens, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: " not in got:  # the first chunk: the generation is running
        got += sock.recv(4096)
    sock.close()
    deadline = time.time() + 60
    while time.time() < deadline and server.health()["dropped"] == before:
        time.sleep(0.1)
    h = server.health()
    assert h["dropped"] == before + 1 and h["active"] == 0 and h["waiting"] == 0
    assert complete(server, PROMPTS[3], 8).choices[0].text


# ---- chat on a pair with a chat template ----------------------------------------------------------
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def chat_pair(pair, tmp_path_factory):
    """A copy of the session's tiny pair (conftest.py) given a chat template."""
    root = str(tmp_path_factory.mktemp("chatpair"))
    shutil.copytree(os.path.dirname(pair[0]), root, dirs_exist_ok=True)
    with open(os.path.join(root, "target", "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return os.path.join(root, "target"), os.path.join(root, "assistant")


@pytest.mark.slow
def test_chat_completions_equal_the_cli(chat_pair):
    s = Running("--model", chat_pair[0], "--assistant", chat_pair[1], "--no-warmup")
    try:
        assert "compiling the first programs" not in s.output()
        start = start_line(s, "target")
        assert "/v1/completions, /v1/chat/completions" in start, start  # it has a chat template
        messages = [{"role": "user", "content": "def f(x):"}]
        r = s.client.chat.completions.create(model="target", messages=messages, max_tokens=16)
        cli_run = run_cli("generate", "def f(x):", "--chat", "--model", chat_pair[0], "--assistant", chat_pair[1],
                          "--max-tokens", "16", "--json", "--compile-cache", CACHE)
        assert cli_run.returncode == 0, cli_run.stderr
        assert r.choices[0].message.content == json.loads(cli_run.stdout)["text"]
        assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
        chunks = list(s.client.chat.completions.create(model="target", messages=messages, max_tokens=16, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    finally:
        s.stop()


def test_a_failing_admission_ends_that_request_only(monkeypatch, chat_pair):
    """In-process scheduler (no HTTP), on the tiny pair: a prefill that fails with an internal error
    ends its request with a 500 error event, a refused one with a 400, and the next request is served."""
    from jaxspec import models
    from jaxspec.engine.batching import BatchEngine
    from jaxspec.serve.app import Server
    from jaxspec.serve.scheduler import EndEvent, ErrorEvent, TextEvent
    from jaxspec.text import load_tokenizer
    from jaxspec.kernels import DispatchConfig

    xla = DispatchConfig(backend="xla")
    target = models.load_target(chat_pair[0], matmul=xla)
    assistant = models.load_assistant(chat_pair[1], matmul=xla)
    srv = Server(target, assistant, load_tokenizer(chat_pair[0]), model_name="m", max_batch=2)
    real = BatchEngine.admit
    failures = iter([RuntimeError("device lost"), ValueError("refused")])

    def admit(self, *a, **kw):
        e = next(failures, None)
        if e is not None:
            raise e
        return real(self, *a, **kw)
    monkeypatch.setattr(BatchEngine, "admit", admit)

    def run(prompt):
        events, done = [], threading.Event()
        job, _ = srv.job(json.dumps({"prompt": prompt, "max_tokens": 6}).encode(), chat=False)
        job.emit = lambda ev: (events.append(ev), not isinstance(ev, TextEvent) and done.set())
        with srv.cond:
            srv.queue.append(job)
            srv.cond.notify()
        assert done.wait(120)
        return events
    failed = run(PROMPTS[0])[-1]
    assert isinstance(failed, ErrorEvent) and failed.status == 500
    refused = run(PROMPTS[0])[-1]
    assert isinstance(refused, ErrorEvent) and refused.status == 400
    ok = run(PROMPTS[0])
    assert isinstance(ok[-1], EndEvent) and "".join(e.piece for e in ok if isinstance(e, TextEvent))
    assert srv.active == 0 and srv.waiting == 0
    srv.close()
