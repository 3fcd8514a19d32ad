"""The server's scheduler over the engine's shared KV pool (in process, the tiny pair): a long
request runs in the batch (no "runs alone" path); a request that needs more blocks than are free
waits in the queue, the next one past --max-queue is a 429, and the running request's text is what
it gives alone; one that fits no pool at all is a 400; a client that leaves mid-prefill frees its
blocks."""
import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")

from jaxspec import cli, models  # noqa: E402
from jaxspec.engine import sampling
from jaxspec.serve import app as server
from jaxspec.serve.app import ApiError, Job, Server  # noqa: E402
from jaxspec.serve.scheduler import EndEvent, ErrorEvent, TextEvent  # noqa: E402
from jaxspec.text.tokenizer import DEMO_CORPUS, Tokenizer, train_byte_bpe  # noqa: E402
from support.seeds import seeded_rng  # noqa: E402

TARGET, ASSISTANT = models.presets.tiny_pair(seed=0)
TOK = Tokenizer(train_byte_bpe([DEMO_CORPUS], vocab_size=TARGET.config.vocab_size))


def _job(ids, n):
    job = Job(ids=list(ids), max_tokens=n, stop=[], params=sampling.SamplingParams(), seed=0)
    job.events, job.ended = [], threading.Event()

    def emit(ev):
        job.events.append(ev)
        if isinstance(ev, (EndEvent, ErrorEvent)):
            job.ended.set()
    job.emit = emit
    return job


def _text(job):
    assert job.ended.wait(120), "the request never ended"
    assert isinstance(job.events[-1], EndEvent), job.events[-1]
    return "".join(ev.piece for ev in job.events if isinstance(ev, TextEvent))


def _queue(srv, job):
    """Queue without waking the worker (it sleeps while nothing runs), as submit does."""
    with srv.cond:
        srv.queue.append(job)


def test_exhausted_pool_queues_then_429_and_the_running_request_is_intact():
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    # 13 blocks of 16: the long request (150 + 32 + K positions) takes 12, the short one needs 2
    srv = Server(TARGET, ASSISTANT, TOK, model_name="m", max_batch=2, max_queue=1, kv_positions=13 * 16,
                 prefill_chunk=64, rounds_per_chunk=1)
    long_ids, short_ids = rng.integers(3, vocab, 150).tolist(), rng.integers(3, vocab, 6).tolist()
    long, short = _job(long_ids, 32), _job(short_ids, 16)
    _queue(srv, long)
    _queue(srv, short)
    srv.scheduler._admit()  # the worker's admission, here: the long one is in, the short one waits for blocks
    engine = srv.engine
    assert len(srv.scheduler.slots) == 1 and srv.waiting == 1 and engine.free == 1
    assert not engine.can_admit(len(short_ids), 16)

    async def submit():
        return srv.submit(_job(short_ids, 16))
    with pytest.raises(ApiError) as e:  # the queue is full: refused before it queues
        asyncio.run(submit())
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
    with srv.cond:
        srv.cond.notify()  # the worker runs: the long request, then the short one once blocks are back
    together = (_text(long), _text(short))
    assert long.events[-1].n_tokens == 32  # its whole budget (the tiny pair has no stop token in reach)
    again = [_job(long_ids, 32), _job(short_ids, 16)]  # each alone
    for job in again:
        _queue(srv, job)
        with srv.cond:
            srv.cond.notify()
        _text(job)
    assert together == (_text(again[0]), _text(again[1]))
    assert len(engine.free_blocks) == engine.kv_blocks  # every block back
    srv.close()


def test_a_request_past_the_pool_is_a_400_and_a_gone_client_frees_its_blocks():
    rng = seeded_rng()
    srv = Server(TARGET, ASSISTANT, TOK, model_name="m", max_batch=2, kv_positions=8 * 16, prefill_chunk=16,
                 rounds_per_chunk=1)
    too_long = _job(rng.integers(3, 500, 120).tolist(), 32)  # 10 blocks of a pool of 8
    _queue(srv, too_long)
    gone = _job(rng.integers(3, 500, 100).tolist(), 8)  # 7 chunks of 16: its client leaves after the first
    _queue(srv, gone)
    with srv.cond:
        srv.cond.notify()
    assert too_long.ended.wait(60)
    error = too_long.events[-1]
    assert isinstance(error, ErrorEvent) and error.status == 400
    assert "KV pool" in error.message
    assert "holds 128 positions" in error.message and "--kv-positions" in error.message
    engine = srv.engine
    deadline = time.time() + 60
    while engine.chunks == 0 and time.time() < deadline:
        time.sleep(0.001)
    gone.cancelled.set()
    while srv.dropped == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert srv.dropped == 1 and not gone.ended.is_set()
    assert len(engine.free_blocks) == engine.kv_blocks
    srv.close()


def test_a_pool_of_one_block_warms_up_and_names_itself_in_its_400():
    """The smallest --kv-positions (16) warms up (its request's budget fits the pool), and a request
    past the pool is then refused by the schema, naming the pool's positions and the flag; a pool
    that holds no request at all (K = 16 needs 17 positions) is refused at the warm-up."""
    srv = Server(TARGET, ASSISTANT, TOK, model_name="m", max_batch=2, kv_positions=16, rounds_per_chunk=1)
    srv.engine.warm_up = lambda: None  # the engine's own (every program of the ladder): not what is tested
    srv.warm_up()  # the scheduler's request through the engine, its budget cut to what the pool holds
    with pytest.raises(ApiError) as e:
        srv.job(json.dumps({"prompt": "def fibonacci(n): return n", "max_tokens": 8}).encode(), False)
    assert e.value.status == 400 and e.value.body()["error"]["code"] == "exceeds_batch_slot"
    assert "KV pool the slots share holds 16 positions" in str(e.value) and "--kv-positions" in str(e.value)
    srv.job(json.dumps({"prompt": "def", "max_tokens": 1}).encode(), False)  # one that fits the pool
    wide = Server(TARGET, ASSISTANT, TOK, model_name="m", max_batch=2, kv_positions=16, block_size=16)
    with pytest.raises(ValueError, match="KV pool of 16 positions holds no request.*--kv-positions"):
        wide.warm_up()
    srv.close()
    wide.close()


def test_serve_builds_its_server_with_kv_positions(pair, monkeypatch):
    """`jaxspec serve --kv-positions N`: the server's engine gets a pool of N positions."""
    built = []
    monkeypatch.setattr(server, "serve", lambda srv, *a, **kw: built.append(srv))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    assert cli.main(["serve", "--model", pair[0], "--assistant", pair[1], "--max-batch", "2", "--kv-positions", "160",
                     "--no-warmup", "--port", port]) == 0
    engine = built[0].engine
    assert engine.kv_blocks * engine.block_tokens == 160 and engine.slots == 2


def _post(app, path: str, body: dict) -> int:
    """One request through the ASGI app, in process: its response's status."""
    raw, sent = json.dumps(body).encode(), []
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():  # the body, then a client that stays (a disconnect would end it with a 499)
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_close_ends_its_requests_and_releases_the_engine():
    """Server.close (on a server keeping a chosen number of ring snapshots): the worker stops, a running and a waiting request end with a 503 (one end each),
    the engine (its KV pool, its ring snapshots) is no longer held by anything (the worker thread held
    the server, so each server a process built kept its device memory), and a request after it is a
    503 before any compute, over HTTP too; a second close does nothing."""
    import gc
    import weakref

    from jaxspec.serve.scheduler import Closed

    rng = seeded_rng()
    snapshots = int(rng.integers(1, 9))  # serve --ring-snapshots: the engine keeps that many
    srv = Server(TARGET, ASSISTANT, TOK, model_name="m", max_batch=1, kv_positions=16 * 16, prefill_chunk=16,
                 rounds_per_chunk=1, ring_snapshots=snapshots)
    assert srv.engine.snaps.size == snapshots
    app = srv.app()
    bad = {"model": "m", "prompt": [5, 6], "max_tokens": -1}
    assert _post(app, "/v1/completions", bad) == 400  # the route answers (no compute): refused by the schema
    running, waiting = _job(rng.integers(3, 500, 40).tolist(), 8), _job(rng.integers(3, 500, 6).tolist(), 4)
    _queue(srv, running)
    _queue(srv, waiting)
    srv.scheduler._admit()  # the worker's admission, here (the worker sleeps): one runs, one waits for the slot
    assert len(srv.scheduler.slots) == 1 and srv.waiting == 1
    engine = weakref.ref(srv.engine)
    worker, srv.scheduler.worker = srv.scheduler.worker, threading.current_thread()  # as if from a job's emit
    with pytest.raises(RuntimeError, match="worker's thread would wait for itself"):
        srv.close()
    srv.scheduler.worker = worker
    assert not srv.scheduler.closed and worker.is_alive()
    srv.close()
    assert not srv.scheduler.worker.is_alive()
    for job in (running, waiting):
        assert len(job.events) == 1 and isinstance(job.events[0], ErrorEvent) and job.events[0].status == 503
    gc.collect()
    assert engine() is None

    async def submit():
        return srv.submit(_job([5, 6, 7], 4))
    with pytest.raises(ApiError) as e:
        asyncio.run(submit())
    assert e.value.status == 503
    with pytest.raises(Closed):
        srv.engine
    assert _post(app, "/v1/completions", {"model": "m", "prompt": [5, 6], "max_tokens": 1}) == 503
    assert _post(app, "/v1/completions", bad) == 503  # before its body is read
    srv.close()  # a second close does nothing
