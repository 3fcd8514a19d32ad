"""`jaxspec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra).

    POST /v1/completions, POST /v1/chat/completions   (`stream: true` for server-sent events)
    GET /v1/models, GET /health, GET /metrics (Prometheus text: `jaxspec.serve.metrics`)

Requests decode together, continuously batched (`jaxspec.engine.batching.BatchEngine`): one worker thread
admits waiting requests into free slots between rounds (in arrival order), runs a round for every
live slot, and retires finished ones. Every sampling setting shares the batch: temperature, top_p,
top_k, min_p, seed, logit_bias, the penalties and logprobs are per-row values of one engine, so a new
setting compiles nothing. A request with `n` choices is n requests of the batch (choice i seeded
seed + i), answered together. Long and short requests share the batch: the slots draw their KV cache from one pool of
blocks (a request takes what its prompt and budget need), and a prompt is prefilled in chunks
between decode steps, so a long prompt does not stop the other streams for its whole prefill. A
request past a request's capacity or the whole pool is refused (a 400 naming the limit); one that
fits waits in the queue until a slot and its blocks are free. Its output is exactly what
`jaxspec generate` gives it (greedy: the CLI's text; sampled: the same for the same seed on CPU;
on a GPU the same distribution, see `jaxspec.engine.batching`). Between
rounds the worker reads the tokens, stops at a stop string, and drops a request whose client went
away (streaming or not). Bad requests get OpenAI's error JSON with a 4xx status before anything
runs; a field the server does not implement is a 400 naming it, never ignored. Responses carry
`usage` and a `jaxspec` object (mode, K, acceptance, tokens per round, batch slots). In front of
the app, `serve_guard.Guard` checks the API key, Host, CORS, content type and body size.

In layers (as vLLM's protocol -> serving -> engine): `openai_schema` (the API's JSON <-> the
request object, `sampling.SamplingParams`), `scheduler` (the worker thread and its batch engine),
and this module (the routes, streaming, serving with uvicorn); `config.ServeConfig` holds the
serving knobs and their ranges.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from jaxspec.serve import guard as serve_guard
from jaxspec.serve import metrics as serve_metrics
from jaxspec.engine.batching import BatchEngine
from jaxspec.engine.generate import check_block_size
from jaxspec.serve.config import BATCH_CONTEXT, REQUEST_CONTEXT, ServeConfig  # noqa: F401  (the server's API)
from jaxspec.serve.protocol import ApiError, OpenAISchema, max_token_bytes, parse_body  # noqa: F401  (the server's API)
from jaxspec.serve.scheduler import Closed, ErrorEvent, Job, QueueFull, Scheduler, TextEvent
from jaxspec.serve.guard import Guard, error_json

DISCONNECT_POLL_S = 0.25  # a waiting non-streaming request checks this often whether its client left
LARGE_BODY = 64 << 10  # a body past this many bytes (or of unknown length) is a large one
MAX_LARGE_BODIES = 4   # large bodies read and parsed at once; more wait (unread: the client's TCP window)


class Server:
    """The models, the tokenizer and the one worker thread; `app()` is the FastAPI application.
    `config` (a `ServeConfig`, or its fields as keywords: `Server(..., max_batch=8)`; both: the
    keywords replace its fields) says how it batches and queues, each knob checked against
    `config.RANGES` before anything is built.
    `max_batch`: slots decoding together (continuous batching), any mix of sampling settings in one
    batch; `rounds_per_chunk`: rounds between two reads of the new tokens (and two admissions),
    1..64. The host's ~1.5 ms per chunk overlaps the device's rounds, so a large model loses nothing
    to it (12B: 1 round 183 tokens/s for one client, 4 rounds 173, as the first token waits a longer
    chunk); a small one is bound by it (the default pair: 4 rounds 2,169 tokens/s, 1 round 631).
    Hence 4 by default (docs/benchmark_results/serve-h200-2026-12-02.md). `max_queue`: requests
    waiting for a slot at most; more are answered 429 with Retry-After. `kv_positions`: the KV pool the
    slots share, in cache positions (default: max_batch x min(context, BATCH_CONTEXT), the memory
    check's); `prefill_chunk`: the width prompts are cut into, one chunk of a prompt a step;
    `step_tokens`: a step's token budget (the decode rounds first, then chunks of the waiting prompts).
    `max_batch` and `max_context` left None are the machine's (`ServeConfig.resolved`: 1 slot and
    4,096 positions a request on a CPU). `aliases`: other names a request's "model" may give (`jaxspec serve --model gemma-3-270m` serves
    "gemma-3-270m", also named by its file's name); /v1/models lists `model_name` only.
    Three layers: `openai_schema.OpenAISchema` (bodies -> requests, responses), `scheduler.Scheduler`
    (the worker and its batch engine), and here the routes."""

    def __init__(self, target, assistant, tokenizer, config: ServeConfig | None = None, *, model_name: str,
                 drafter=None, aliases: tuple[str, ...] = (), **knobs):
        self.config = ServeConfig.build(config, **knobs).resolved()  # None: the machine's slots and positions
        check_block_size(self.config.block_size, target.config.max_position_embeddings)  # K within the context
        self.target, self.tok, self.model_name = target, tokenizer, model_name
        self.context = target.config.max_position_embeddings
        self.scheduler = Scheduler(target, assistant, tokenizer, self.config, drafter=drafter)
        # a request's positions and budget (config.request_capacity, request_tokens), as the schema checks them
        self.batch_capacity, self.batch_tokens = self.scheduler.batch_capacity, self.scheduler.batch_tokens
        self.schema = OpenAISchema(tokenizer, model_name=model_name, vocab=target.config.vocab_size,
                                   context=self.context, batch_capacity=self.batch_capacity,
                                   batch_tokens=self.batch_tokens, aliases=aliases)
        self.prep = ThreadPoolExecutor(1, thread_name_prefix="jaxspec-tokenize")  # off the event loop

    # The scheduler's state, as the routes (and /health) read it.
    active = property(lambda self: self.scheduler.active)
    waiting = property(lambda self: self.scheduler.waiting)
    dropped = property(lambda self: self.scheduler.dropped)
    served = property(lambda self: self.scheduler.served)
    queue = property(lambda self: self.scheduler.queue)
    cond = property(lambda self: self.scheduler.cond)
    compiles = property(lambda self: self.scheduler.compiles)

    @property
    def engine(self) -> BatchEngine:
        return self.scheduler.engine

    def submit(self, job: Job):
        """`Scheduler.submit`; a full queue is a 429 with Retry-After."""
        try:
            return self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(429, f"{e.waiting} requests are waiting (--max-queue {e.limit}): retry in {e.retry_after} s",
                           code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        except Closed as e:
            raise ApiError(503, str(e)) from None

    def close(self) -> None:
        """`Scheduler.close` (the worker stopped, waiting and running requests ended with a 503, the
        engine's device memory released) and the tokenizer's thread; a request after it is a 503.
        Not from a request's handler: it waits for the worker's step."""
        self.scheduler.close()
        self.prep.shutdown(wait=True)

    def warm_up(self) -> float:
        """`Scheduler.warm_up` (every program a request that fits a slot runs); from then on a
        request that fits no slot is refused. Seconds."""
        s = self.scheduler.warm_up()
        engine = self.scheduler.engine
        self.schema.slot_room, self.schema.kv_pool = engine.room, engine.kv_blocks * engine.block_tokens
        return s

    def job(self, raw: bytes, chat: bool) -> tuple[Job, bool]:
        """A request body -> (its first choice's Job, stream); ApiError for anything wrong, before
        any compute."""
        jobs, stream = self.jobs(raw, chat)
        return jobs[0], stream

    def jobs(self, raw: bytes, chat: bool) -> tuple[list[Job], bool]:
        """A request body -> (one Job per choice, stream): choice i is the request with seed + i
        (`OpenAISchema.choice_seed`), its own row of the batch. ApiError before any compute."""
        ids, params, stream, n = self.schema.request(raw, chat)
        jobs = []
        for i in range(n):
            p = dataclasses.replace(params, seed=self.schema.choice_seed(params.seed, i))
            jobs.append(Job(ids=ids, max_tokens=p.max_new_tokens, stop=list(p.stop), params=p, seed=p.seed,
                            logprobs=p.logprobs))
        return jobs, stream

    def submit_all(self, jobs: list[Job]) -> list[asyncio.Queue]:
        """Queue every choice's job, or none: a 429 for one cancels those already queued."""
        queues = []
        try:
            for job in jobs:
                queues.append(self.submit(job))
        except ApiError:
            for job in jobs[:len(queues)]:
                job.cancelled.set()
            raise
        return queues

    def app(self) -> FastAPI:
        app = FastAPI(title="jaxspec")

        @app.exception_handler(ApiError)
        async def api_error(_, e: ApiError):
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": self.model_name, "active": self.active, "waiting": self.waiting,
                    "dropped": self.dropped, "served": self.served,
                    "compiles": [p.name for p in self.compiles.programs if p.lower_s or p.compile_s]}

        @app.get("/metrics")
        async def metrics():
            return Response(self.scheduler.render_metrics(), media_type=serve_metrics.CONTENT_TYPE)

        @app.get("/v1/models")
        async def models_():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "jaxspec"}]}

        large = asyncio.Semaphore(MAX_LARGE_BODIES)

        async def handle(request: Request, chat: bool):
            if self.scheduler.closed:  # before the tokenizer's thread, shut down with it
                raise ApiError(503, "the server is shutting down")
            length = request.headers.get("content-length", "")
            big = not length.isdigit() or int(length) > LARGE_BODY
            async with large if big else contextlib.nullcontext():  # bodies in memory at once: bounded
                try:
                    raw = await request.body()
                except ClientDisconnect:  # gone mid-body (or cut at --max-body-bytes): one line, no traceback
                    if not request.scope.get(serve_guard.DROPPED):
                        serve_guard.log_drop(request.client, "its request body ended early (it went away, or the "
                                                             "body passed --max-body-bytes)")
                    return Response(status_code=499)
                jobs, stream = await asyncio.get_running_loop().run_in_executor(self.prep, self.jobs, raw, chat)
            head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                    "model": self.model_name}
            queues = self.submit_all(jobs)
            if stream:
                return StreamingResponse(self._sse(jobs, queues, head, chat), media_type="text/event-stream")
            choices, used, first_stats = [], 0, None
            clock = asyncio.get_running_loop().time
            check = clock() + DISCONNECT_POLL_S
            # The choices run together in the batch; their events wait in their queues while an
            # earlier choice's are read.
            for i, (job, events) in enumerate(zip(jobs, queues)):
                text, entries, end = "", [], None
                while end is None:
                    try:
                        ev = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        ev = None
                    if clock() >= check:  # every poll interval, events or not
                        check = clock() + DISCONNECT_POLL_S
                        if await request.is_disconnected():  # nobody will read the answer: stop its work
                            _cancel(jobs)
                            return JSONResponse({}, status_code=499)
                    if ev is None:
                        continue
                    if isinstance(ev, TextEvent):
                        text += ev.piece
                        entries += ev.entries
                    else:
                        end = ev
                if isinstance(end, ErrorEvent):
                    _cancel(jobs)
                    kind = "invalid_request_error" if end.status < 500 else "server_error"
                    return JSONResponse(error_json(end.message, kind=kind), status_code=end.status)
                entries += end.entries
                lps = None if job.logprobs is None else self.schema.logprobs_json(entries, chat)
                choice = ({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                           "finish_reason": end.reason}
                          if chat else {"index": i, "text": text, "logprobs": lps, "finish_reason": end.reason})
                if len(jobs) > 1:
                    choice["jaxspec"] = end.stats  # each choice's own decoding
                choices.append(choice)
                used += end.n_tokens
                first_stats = first_stats or end.stats
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                    "usage": self.schema.usage(len(jobs[0].ids), used), "jaxspec": first_stats}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, chat=True)

        return app

    async def _sse(self, jobs, queues, head, chat):
        """The choices' chunks as their tokens come, each with its choice's index; the last choice
        to end carries the usage of all."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(jobs)  # characters sent per choice (completions' text_offset)
        first = [True] * len(jobs)

        def chunk(i, piece, entries, reason=None, **extra):
            lps = None if jobs[i].logprobs is None else self.schema.logprobs_json(entries, chat, sent[i])
            if chat:
                delta = ({"role": "assistant"} if first[i] else {}) | ({"content": piece} if piece else {})
                choice = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason}
            else:
                choice = {"index": i, "text": piece, "logprobs": lps, "finish_reason": reason}
            first[i] = False
            return f"data: {json.dumps({**head, 'object': obj, 'choices': [choice], **extra})}\n\n"

        used, left = 0, len(jobs)
        try:
            async with contextlib.aclosing(_merged(queues)) as events:
                async for i, ev in events:
                    if isinstance(ev, TextEvent):
                        if ev.piece or ev.entries:
                            yield chunk(i, ev.piece, ev.entries)
                            sent[i] += len(ev.piece)
                        continue
                    if isinstance(ev, ErrorEvent):
                        yield f"data: {json.dumps({'error': {'message': ev.message, 'type': 'server_error'}})}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    used, left = used + ev.n_tokens, left - 1
                    last = {"usage": self.schema.usage(len(jobs[0].ids), used)} if not left else {}
                    yield chunk(i, "", ev.entries, ev.reason, **last, jaxspec=ev.stats)
                    if not left:
                        yield "data: [DONE]\n\n"
                        return
        finally:  # also when the client went away: the worker drops the jobs at their next chunk
            _cancel(jobs)


def _cancel(jobs) -> None:
    for job in jobs:
        job.cancelled.set()


async def _merged(queues):
    """(index, event) from several queues, each event as soon as it is there, each queue's in order."""
    getters = {asyncio.ensure_future(q.get()): i for i, q in enumerate(queues)}
    try:
        while True:
            done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=getters.get):
                i = getters.pop(fut)
                getters[asyncio.ensure_future(queues[i].get())] = i
                yield i, fut.result()
    finally:
        for fut in getters:
            fut.cancel()


def serve(server: Server, host: str, port: int, announce=None, *, api_key: str | None = None,
          allow_origins: tuple[str, ...] = (), max_body_bytes: int = 1 << 20, allowed_hosts: tuple[str, ...] = (),
          max_connections: int = 512, idle_timeout: float = 5.0, header_timeout: float = 10.0,
          body_timeout: float = 60.0) -> None:
    """Serve `server.app()` behind `serve_guard.Guard` (API key, Host check, CORS, content type,
    body size) with uvicorn until interrupted, its connections limited by
    `serve_guard.http_protocol` (a cap, idle / header / body timeouts)."""
    import uvicorn

    app = Guard(server.app(), api_key=api_key, allow_origins=allow_origins, max_body_bytes=max_body_bytes,
                bound_host=host, allowed_hosts=allowed_hosts)
    protocol = serve_guard.http_protocol(max_connections=max_connections, idle_timeout=idle_timeout,
                                         header_timeout=header_timeout, body_timeout=body_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=protocol,
                            timeout_keep_alive=idle_timeout, backlog=serve_guard.ACCEPT_BACKLOG)
    srv = uvicorn.Server(config)

    async def started():
        while not srv.started:
            await asyncio.sleep(0.05)
        if announce is not None:
            announce()

    async def main():
        asyncio.get_running_loop().set_exception_handler(serve_guard.quiet_accept_errors)
        await asyncio.gather(srv.serve(), started())
    asyncio.run(main())
