"""`jaxspec serve` under real traffic, on CPU: a real server process over a tiny pair, with an API key
from $JAXSPEC_API_KEY and 16 slots, talked to with the official `openai` client and raw HTTP.

- 16 concurrent requests with 16 distinct (temperature, top_p) settings share the batch, nothing is
  compiled after the warm-up (the server's compile log), and each output equals its run alone;
- the guard: 401 without the key, 415 for text/plain, 400 for a foreign Host, 413 for a body past
  --max-body-bytes while /health keeps answering;
- logprobs equal a float64 log_softmax of the target's own logits; logit_bias steers the output;
- a non-streaming client that goes away is cancelled; unsupported fields are 400s naming them;
- a full queue answers 429 with Retry-After (in process).
"""
import asyncio
import json
import math
import socket
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.seeds import seeded_rng  # noqa: E402
from support.server_proc import concurrently  # noqa: E402

KEY = "test-key-7f3a"
PROMPTS = ["def f(x):", "import os", "class A:", "for i in", "x = [1,", "return 2", "while n:", "if a == b:"]
LIMIT = 65536  # --max-body-bytes


@pytest.fixture(scope="module")
def server(tiny_server):
    """One server for the module (conftest.py's tiny pair and batch settings), with the API key."""
    return tiny_server("--max-body-bytes", str(LIMIT), api_key=KEY)


def complete(server, prompt, **kw):
    return server.client.completions.create(model="target", prompt=prompt, **kw)


def test_sixteen_settings_share_the_batch_without_compiling(server):
    settings = [(round(0.1 * i, 2), [None, 0.95, 0.8, 0.5][i % 4]) for i in range(16)]  # (0.0, None) greedy
    assert len(set(settings)) == 16
    compiled = server.health()["compiles"]
    got, busiest = concurrently(server, [
        lambda i=i: complete(server, PROMPTS[i % 8], max_tokens=12, temperature=settings[i][0], top_p=settings[i][1],
                             seed=100 + i) for i in range(16)])
    assert busiest >= 4  # they decoded together
    assert server.health()["compiles"] == compiled  # no setting compiled anything
    texts = [r.choices[0].text for r in got]
    for i, (t, p) in enumerate(settings):  # each equals its run alone
        alone = complete(server, PROMPTS[i % 8], max_tokens=12, temperature=t, top_p=p, seed=100 + i)
        assert alone.choices[0].text == texts[i], (i, t, p)
    assert len(set(texts[8:])) > 1  # sampled rows are not all one text
    assert server.health()["compiles"] == compiled


def _raw(server, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One raw HTTP/1.1 request; (status, response bytes)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head + body)
        got = b""
        while True:
            part = sock.recv(65536)
            if not part:
                break
            got += part
    return int(got.split(b" ", 2)[1]), got


def test_the_guard_key_content_type_and_host(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="target", prompt="x", max_tokens=2)
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode()
    assert _raw(server, head + b"\r\n", body)[0] == 401  # no key at all
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    assert _raw(server, head + auth + b"\r\n", body)[0] == 200
    plain = head.replace(b"application/json", b"text/plain")
    status, reply = _raw(server, plain + auth + b"\r\n", body)
    assert status == 415 and b"text/plain" in reply
    evil = head.replace(f"127.0.0.1:{server.port}".encode(), b"evil.example:8000")
    assert _raw(server, evil + auth + b"\r\n", body)[0] == 400
    assert server.health()["status"] == "ok"  # /health needs no key


def test_an_oversized_body_is_413_while_health_answers(server):
    """A client streams a chunked body slowly past --max-body-bytes: /health answers within a second
    the whole time, and the upload ends with a 413."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    piece = b'{"prompt": "' + b"a" * 8000
    sent, slowest = 0, 0.0
    try:
        while sent <= 2 * LIMIT:
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
            piece = b"a" * 8000
            t0 = time.perf_counter()
            server.health()
            slowest = max(slowest, time.perf_counter() - t0)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered 413 and closed
    got = b""
    try:
        while b"\r\n\r\n" not in got:
            part = sock.recv(4096)
            if not part:
                break
            got += part
    finally:
        sock.close()
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert slowest < 1.0
    assert complete(server, PROMPTS[0], max_tokens=2).choices[0].text is not None


def _load(pair):
    """The server's models in process (the CLI's CPU choices: xla backend, bfloat16) and tokenizer."""
    from jaxspec import models
    from jaxspec.text import load_tokenizer
    from jaxspec.kernels import DispatchConfig

    xla = DispatchConfig(backend="xla")
    return (models.load_target(pair[0], matmul=xla), models.load_assistant(pair[1], matmul=xla),
            load_tokenizer(pair[0]))


def test_logprobs_are_the_targets_log_softmax(server, pair):
    """Greedy with logprobs=3: each token's logprob is the float64 log_softmax of the target's logits
    over prompt + output (one forward in this process) at that token, and the most likely of its
    alternatives; streamed chunks carry the same values."""
    import jax.numpy as jnp

    import jaxspec
    from jaxspec import models

    target, _, tok = _load(pair)
    prompt = tok.encode(PROMPTS[0])
    r = complete(server, prompt, max_tokens=8, logprobs=3)
    lp = r.choices[0].logprobs
    ids = jaxspec.generate(target, prompt, max_new_tokens=8, block_size=1, eos_token_ids=tok.eos_token_ids).tokens[0]
    assert tok.decode(ids) == r.choices[0].text and len(lp.token_logprobs) == len(ids) == r.usage.completion_tokens
    cache = models.init_cache(target.config, 1, 64, jnp.bfloat16, max_block=64)
    x = np.asarray(models.forward(target, jnp.asarray([prompt + ids], jnp.int32), cache)[0][0], np.float64)
    top = x.max(-1, keepdims=True)
    ref = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))  # log_softmax in float64
    at = len(prompt) - 1 + np.arange(len(ids))
    np.testing.assert_allclose(lp.token_logprobs, ref[at, ids], atol=0.05)
    for i, alts in enumerate(lp.top_logprobs):  # greedy: the chosen token is the most likely one
        assert math.isclose(lp.token_logprobs[i], max(alts.values()), abs_tol=1e-6)
        best = np.sort(ref[at[i]])[::-1][:3]  # (strings of byte tokens may coincide: fewer keys)
        assert all(np.min(np.abs(best - v)) < 0.05 for v in alts.values()) and 1 <= len(alts) <= 3
    chunks = server.client.completions.create(model="target", prompt=prompt, max_tokens=8, logprobs=0, stream=True)
    streamed = sum((c.choices[0].logprobs.token_logprobs for c in chunks if c.choices[0].logprobs), [])
    assert streamed == lp.token_logprobs


def test_logit_bias_steers_the_output(server, pair):
    """-100 on the greedy first token: the server's text is the library's with that bias, whose
    first token differs; +100 on one token: every sampled token is that one."""
    import jaxspec

    target, assistant, tok = _load(pair)
    prompt = tok.encode(PROMPTS[1])
    kw = dict(max_new_tokens=6, block_size=1, eos_token_ids=tok.eos_token_ids)
    first = jaxspec.generate(target, prompt, **kw).tokens[0][0]
    banned = jaxspec.generate(target, prompt, logit_bias={first: -100.0}, **kw).tokens[0]
    assert banned[0] != first
    r = complete(server, prompt, max_tokens=6, logit_bias={str(first): -100})
    assert r.choices[0].text == tok.decode(banned)
    forced = tok.encode("e", add_special_tokens=False)[0]
    r = complete(server, prompt, max_tokens=6, temperature=0.9, seed=3, logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 6)


def test_penalties_equal_the_librarys(server, pair):
    """Greedy with all three penalties: the server's text (its batch engine: the penalised step program,
    the first token from the chunked prefill, the counts written into the slot) is the library's
    classic decoding with them, which differs from decoding without them."""
    import jaxspec

    target, _, tok = _load(pair)
    prompt = tok.encode(PROMPTS[5])
    pen = dict(presence_penalty=0.8, frequency_penalty=0.6)
    kw = dict(max_new_tokens=12, block_size=1, eos_token_ids=tok.eos_token_ids)
    want = jaxspec.generate(target, prompt, repetition_penalty=1.5, **pen, **kw).tokens[0]
    assert want != jaxspec.generate(target, prompt, **kw).tokens[0]
    r = complete(server, prompt, max_tokens=12, extra_body={"repetition_penalty": 1.5}, **pen)
    assert r.choices[0].text == tok.decode(want)


def test_n_choices_are_their_own_requests_seeded_seed_plus_i(server):
    """n = 4 with a seed: four choices, choice i the text of its own request (n = 1) with seed + i; usage
    counts every choice (the prompt once). Streamed, each chunk names its choice and the pieces join to
    the same texts, the last chunk carrying the usage. n = 16 beside it (20 rows, 16 slots) queues."""
    kw = dict(max_tokens=10, temperature=1.0, frequency_penalty=0.5)
    seed = int(seeded_rng().integers(0, 2**62))
    r = complete(server, PROMPTS[3], n=4, seed=seed, **kw)
    alone = [complete(server, PROMPTS[3], seed=seed + i, **kw) for i in range(4)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    chunks = list(server.client.completions.create(model="target", prompt=PROMPTS[3], n=4, seed=seed, stream=True,
                                                   **kw))
    texts = [""] * 4
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [c.text for c in r.choices]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert sum(bool(ch.finish_reason) for c in chunks for ch in c.choices) == 4
    wide_kw = dict(n=16, max_tokens=6, temperature=0.8, seed=int(seeded_rng().integers(0, 2**62)))
    (wide, four), busiest = concurrently(server, [
        lambda: complete(server, PROMPTS[0], **wide_kw),
        lambda: complete(server, PROMPTS[3], n=4, seed=seed, **kw)])
    assert [c.index for c in wide.choices] == list(range(16)) and all(c.finish_reason for c in wide.choices)
    # a choice may sample end-of-text first (empty text): compare with the same request run alone instead
    assert [c.text for c in wide.choices] == [c.text for c in complete(server, PROMPTS[0], **wide_kw).choices]
    assert [c.text for c in four.choices] == texts and 4 <= busiest <= 16


@pytest.mark.parametrize("field,value", [
    ("echo", True), ("suffix", "x"), ("best_of", 3), ("tools", []), ("response_format", {"type": "json_object"}),
])
def test_unsupported_fields_are_400_naming_them(server, field, value):
    body = {"prompt": "x", "max_tokens": 2, field: value}
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model="target", prompt="x", max_tokens=2, extra_body={field: value})
    assert field in str(e.value) and e.value.body["param"] == field, body
    assert complete(server, "x", max_tokens=2, presence_penalty=0, echo=False).choices[0].text is not None


def test_a_non_streaming_client_that_goes_away_is_cancelled(server, pair):
    from jaxspec.text import load_tokenizer

    before = server.health()
    no_eos = {str(t): -100 for t in load_tokenizer(pair[0]).eos_token_ids}  # it would run its whole budget
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 128, "logit_bias": no_eos}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.time() + 60
    while time.time() < deadline and server.health()["active"] == 0:
        time.sleep(0.01)
    sock.close()
    while time.time() < deadline and server.health()["dropped"] == before["dropped"]:
        time.sleep(0.05)
    h = server.health()
    assert h["dropped"] == before["dropped"] + 1 and h["served"] == before["served"]
    assert h["active"] == 0 and h["waiting"] == 0


def test_a_full_queue_is_429_with_retry_after():
    """In process: with --max-queue 2 and two requests waiting, the next is refused before it queues."""
    from jaxspec import models
    from jaxspec.serve.app import ApiError, Job, Server
    from jaxspec.text.tokenizer import DEMO_CORPUS, train_byte_bpe
    from jaxspec.engine import sampling

    target, assistant = models.presets.tiny_pair(seed=0)
    tok = train_byte_bpe([DEMO_CORPUS], vocab_size=target.config.vocab_size)
    srv = Server(target, assistant, tok, model_name="m", max_queue=2)
    waiting = [Job(ids=[3], max_tokens=2, stop=[], params=sampling.SamplingParams(), seed=0) for _ in range(2)]
    for job in waiting:  # queued without waking the worker: they stay waiting
        job.cancelled.set()
        srv.queue.append(job)

    async def submit():
        job = Job(ids=[3], max_tokens=2, stop=[], params=sampling.SamplingParams(), seed=0)
        job.cancelled.set()  # its client "left": the worker drops it without answering
        return srv.submit(job)
    with pytest.raises(ApiError) as e:
        asyncio.run(submit())
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1 and "--max-queue" in e.value.message
    assert srv.dropped == 0  # refused before it queued; the worker still sleeps
    srv.queue.popleft()
    asyncio.run(submit())  # room again: queued, and the worker wakes and drops the three left jobs
    deadline = time.time() + 30
    while srv.dropped < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert srv.dropped == 2 and srv.waiting == 0
    srv.close()


def test_json_the_parser_refuses_is_a_400(server):
    """A 5000-digit integer (past Python's int-from-text limit) and nesting past the recursion limit
    were 500s; both are the client's malformed input."""
    auth = f"Authorization: Bearer {KEY}\r\n"
    for body in (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", b"[" * 20000 + b"]" * 20000):
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        status, reply = _raw(server, head, body)
        assert status == 400 and b"not valid JSON" in reply, reply[-300:]
    assert server.health()["status"] == "ok"
