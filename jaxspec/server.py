"""`jaxspec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra).

    POST /v1/completions, POST /v1/chat/completions   (`stream: true` for server-sent events)
    GET /v1/models, GET /health

Requests decode together, continuously batched (`jaxspec.batching.BatchEngine`): one worker thread
admits waiting requests into free slots between rounds (in arrival order), runs a round for every
live slot, and retires finished ones. Requests batch when their sampling settings (temperature,
top_k, top_p) are equal; others wait until the running batch drains. A request whose prompt and
budget do not fit a slot runs alone (`streaming.stream_generate`) when no batch is running. Either
way its output is exactly what `jaxspec generate` gives it (greedy: the CLI's text; sampled: the
same for the same seed). Between rounds the worker reads the tokens, stops at a stop string, and
drops a request whose client went away. Bad requests get OpenAI's error JSON with a 4xx status
before anything runs. Responses carry `usage` and a `jaxspec` object (mode, K, acceptance, tokens
per round, batch slots).
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import sampling, streaming
from .batching import BatchEngine
from .generate import BUDGET_BUCKET
from .tokenizer import IncrementalDecoder, TokenizerError

BATCH_CONTEXT = 4096  # cache positions per slot at most (longer requests run alone)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


@dataclass
class Job:
    """One request, validated: the prompt ids and the generation arguments; `emit` (set when it is
    submitted) sends its events to the request's handler."""
    ids: list[int]
    max_tokens: int
    stop: list[str]
    kw: dict
    cancelled: threading.Event = field(default_factory=threading.Event)
    emit: object = None

    @property
    def params(self) -> tuple:
        return self.kw["temperature"], self.kw["top_k"], self.kw["top_p"]


def _fail(job: Job, e: Exception) -> None:
    """End a job with an error: 400 for input the library refused (a ValueError, e.g. a KV cache
    beyond the device's memory), 500 for an internal failure."""
    if isinstance(e, ValueError):
        job.emit(("error", str(e), 400))
    else:
        job.emit(("error", f"{type(e).__name__}: {e}", 500))


class _Text:
    """A job's tokens -> text events: incremental decoding, stop strings (text that may still become
    one is held back), the finish reason; `push` returns True once the job has ended."""

    def __init__(self, tok, job: Job):
        self.tok, self.job = tok, job
        self.dec, self.text, self.held, self.n, self.reason = IncrementalDecoder(tok), "", 0, 0, "length"
        self.keep = max((len(s) for s in job.stop), default=1) - 1

    def push(self, new: list[int], done: bool, stats=None) -> bool:
        emit = self.job.emit
        self.n += len(new)
        if new and new[-1] in self.tok.eos_token_ids:
            self.reason = "stop"
        self.text += self.dec.push(new) + (self.dec.flush() if done else "")
        cut = min((i for i in (self.text.find(s) for s in self.job.stop) if i >= 0), default=-1)
        if cut >= 0:
            emit(("text", self.text[self.held:cut]))
            emit(("end", "stop", self.n, stats))
            return True
        safe = len(self.text) if done else max(self.held, len(self.text) - self.keep)
        if safe > self.held:
            emit(("text", self.text[self.held:safe]))
            self.held = safe
        if done:
            emit(("end", self.reason, self.n, stats))
        return done


# ---- validation ------------------------------------------------------------------------------
def _number(body, name, default, lo, hi, *, integer=False, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or v < lo or v > hi or (lo_open and v == lo):
        kind = "an integer" if integer else "a number"
        rng = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be {kind} {rng}, got {v!r}", name)
    return v


def _stops(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    return stop


class Server:
    """The models, the tokenizer and the one worker thread; `app()` is the FastAPI application.
    `max_batch`: slots decoding together (continuous batching); `rounds_per_chunk`: rounds between
    two reads of the new tokens (and two admissions). The host's ~1.5 ms per chunk overlaps the
    device's rounds, so a large model loses nothing to it (12B: 1 round 183 tokens/s for one
    client, 4 rounds 173, as the first token waits a longer chunk); a small one is bound by it (the
    default pair: 4 rounds 2,169 tokens/s, 1 round 631). Hence 4 by default
    (docs/benchmark_results/serve-h200-2026-12-02.md)."""

    def __init__(self, target, assistant, tokenizer, *, model_name: str, block_size: int = 4,
                 rounds_per_chunk: int = 4, max_batch: int = 4):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.target, self.assistant, self.tok = target, assistant, tokenizer
        self.model_name, self.block_size, self.rounds_per_chunk = model_name, block_size, rounds_per_chunk
        self.max_batch = max_batch
        self.context = target.config.max_position_embeddings
        # per slot: the context (at most BATCH_CONTEXT positions), half of it for the budget
        self.batch_capacity = min(self.context or BATCH_CONTEXT, BATCH_CONTEXT)
        self.batch_tokens = max(1, self.batch_capacity // 2 // BUDGET_BUCKET * BUDGET_BUCKET)
        self.engines: dict[tuple, BatchEngine] = {}  # one per sampling setting; one runs at a time
        self.running: BatchEngine | None = None
        self.slots: dict[int, tuple[Job, _Text]] = {}
        self.queue: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.solo = 0
        self.dropped = 0  # requests stopped because their client went away
        threading.Thread(target=self._work, name="jaxspec-serve", daemon=True).start()

    @property
    def active(self) -> int:
        return len(self.slots) + self.solo

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def engine(self, params: tuple) -> BatchEngine:
        if params not in self.engines:
            # One batch runs at a time: idle engines go first, so that many distinct settings do not
            # each keep a cache of every slot (their compiled programs stay in memory and on disk).
            self.engines = {k: v for k, v in self.engines.items() if v is self.running}
            temperature, top_k, top_p = params
            self.engines[params] = BatchEngine(
                self.target, self.assistant, slots=self.max_batch, max_new_tokens=self.batch_tokens,
                capacity=self.batch_capacity, block_size=self.block_size, temperature=temperature, top_k=top_k,
                top_p=top_p, eos_token_ids=self.tok.eos_token_ids, rounds_per_step=self.rounds_per_chunk)
        return self.engines[params]

    def warm_up(self) -> float:
        """Compile what the most common request needs (a short prompt, greedy: the batch's prefill
        and round) before the first client waits for it; other shapes compile on their first
        request. Seconds."""
        t0 = time.perf_counter()
        ids = (self.tok.encode("Hello") or [1])[:8]
        engine = self.engine((0.0, None, None))
        engine.admit(ids, min(16, self.batch_tokens))
        while engine.live:
            engine.step()
        return time.perf_counter() - t0

    # ---- requests -> jobs ------------------------------------------------------------------------
    def job(self, body, chat: bool) -> Job:
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist: this server serves '{self.model_name}'",
                           "model", "model_not_found")
        if _number(body, "n", 1, 1, 1, integer=True) != 1:
            raise ApiError(400, "'n' must be 1", "n")
        ids = self._chat_ids(body) if chat else self._prompt_ids(body)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", "messages" if chat else "prompt")
        room = None if self.context is None else self.context - len(ids)
        if room is not None and room < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, longer than the model's context of "
                                f"{self.context} tokens", "messages" if chat else "prompt", "context_length_exceeded")
        default = 256 if chat else 16  # completions: OpenAI's default; chat: a bounded stand-in for "the rest"
        max_tokens = _number(body, "max_tokens", min(default, room or default), 1, room or 1 << 20, integer=True)
        temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
        top_p = _number(body, "top_p", None, 0.0, 1.0, lo_open=True)
        top_k = _number(body, "top_k", None, 1, 1 << 30, integer=True)
        seed = _number(body, "seed", None, 0, 2**64 - 1, integer=True)
        if seed is None:  # as OpenAI: without a seed, sampling differs from call to call
            seed = random.getrandbits(63)
        try:
            sampling.validate_sampling(temperature, top_k, top_p)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        kw = dict(assistant=self.assistant, max_new_tokens=max_tokens, block_size=self.block_size,
                  temperature=float(temperature), top_k=top_k, top_p=top_p, seed=seed,
                  eos_token_ids=self.tok.eos_token_ids)
        return Job(ids=ids, max_tokens=max_tokens, stop=_stops(body), kw=kw)

    def _prompt_ids(self, body) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if min(prompt) < 0 or max(prompt) >= self.target.config.vocab_size:
                raise ApiError(400, f"token ids must be in [0, {self.target.config.vocab_size})", "prompt")
            return list(prompt)
        raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids", "prompt")

    def _chat_ids(self, body) -> list[int]:
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects with string "
                                "content", "messages")
        try:
            return self.tok.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
        except TokenizerError as e:
            raise ApiError(400, f"this model cannot chat: {e}", "messages") from None

    # ---- running jobs: the worker thread ------------------------------------------------------------
    def submit(self, job: Job) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job.emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        with self.cond:
            self.queue.append(job)
            self.cond.notify()
        return events

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.slots:
                    self.cond.wait()
            try:
                solo = self._admit()
                if solo is not None:
                    self._run_alone(solo)
                elif self.slots:
                    self._round()
            except Exception as e:  # an internal failure: its requests end with an error, the server keeps serving
                for job, _ in self.slots.values():
                    job.emit(("error", f"{type(e).__name__}: {e}", 500))
                self.slots.clear()
                self.engines = {k: v for k, v in self.engines.items() if v is not self.running}
                self.running = None

    def _admit(self) -> Job | None:
        """Admit waiting jobs in arrival order while they fit the running batch; returns a job that
        must run alone (it fits no slot) once no batch is running."""
        while self.queue:
            job = self.queue[0]
            if job.cancelled.is_set():  # its client left while it waited
                self.queue.popleft()
                self.dropped += 1
                continue
            if not self.slots:
                self.running = None
            try:
                engine = self.engine(job.params)
            except Exception as e:  # e.g. its cache does not fit the device: this request fails, not the server
                self.queue.popleft()
                _fail(job, e)
                continue
            if not engine.fits(len(job.ids), job.max_tokens):
                return None if self.running is not None else self.queue.popleft()
            if (self.running is not None and engine is not self.running) or not engine.free:
                return None  # waits for a free slot, or for the other setting's batch to drain
            self.queue.popleft()
            try:
                slot = engine.admit(job.ids, job.max_tokens, seed=job.kw["seed"], owner=job)
            except Exception as e:  # e.g. non-finite logits from the prompt (400), a failed prefill (500)
                _fail(job, e)
                continue
            self.running = engine
            self.slots[slot] = (job, _Text(self.tok, job))
        return None

    def _round(self) -> None:
        engine = self.running
        for ev in engine.step():
            job, text = self.slots[ev.slot]
            if job.cancelled.is_set():
                engine.cancel(ev.slot)
                del self.slots[ev.slot]
                self.dropped += 1
                continue
            stats = None
            if ev.done:
                n = text.n + len(ev.tokens)
                stats = {"mode": "speculative" if engine.block_size > 1 else "classic",
                         "block_size": engine.block_size,
                         "acceptance_rate": ev.accepted / ev.drafted if ev.drafted else 0.0,
                         "tokens_per_round": (n - 1) / ev.rounds if ev.rounds else 0.0,
                         "rounds": ev.rounds, "fallback": engine.fallback, "batch_slots": engine.slots}
            if text.push(ev.tokens, ev.done, stats):
                if not ev.done:  # a stop string ended it early
                    engine.cancel(ev.slot)
                del self.slots[ev.slot]

    def _run_alone(self, job: Job) -> None:
        """A job no slot fits (prompt + budget past a slot's cache), alone with stream_generate."""
        self.solo += 1
        try:
            text = _Text(self.tok, job)
            for chunk in streaming.stream_generate(self.target, [job.ids], rounds_per_chunk=self.rounds_per_chunk,
                                                   **job.kw):
                if job.cancelled.is_set():
                    self.dropped += 1
                    return
                s = chunk.result.stats if chunk.done else None
                stats = None if s is None else {
                    "mode": s.mode, "block_size": s.block_size, "acceptance_rate": s.acceptance_rate,
                    "tokens_per_round": s.tokens_per_round, "rounds": s.rounds, "fallback": s.fallback,
                    "batch_slots": 1}
                if text.push(chunk.tokens[0], chunk.done, stats):
                    return
        except Exception as e:  # the request ends with an error, the server keeps serving
            _fail(job, e)
        finally:
            self.solo -= 1

    # ---- responses ------------------------------------------------------------------------------
    def _usage(self, job, n):
        return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n}

    def app(self) -> FastAPI:
        app = FastAPI(title="jaxspec")

        @app.exception_handler(ApiError)
        async def api_error(_, e: ApiError):
            return JSONResponse(e.body(), status_code=e.status)

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": self.model_name, "active": self.active, "waiting": self.waiting,
                    "dropped": self.dropped}

        @app.get("/v1/models")
        async def models_():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "jaxspec"}]}

        async def handle(request: Request, chat: bool):
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            job = self.job(body, chat)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise ApiError(400, "'stream' must be a boolean", "stream")
            head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                    "model": self.model_name}
            events = self.submit(job)
            if stream:
                return StreamingResponse(self._sse(job, events, head, chat), media_type="text/event-stream")
            text, end = "", None
            while end is None:
                ev = await events.get()
                if ev[0] == "text":
                    text += ev[1]
                else:
                    end = ev
            if end[0] == "error":
                kind = "invalid_request_error" if end[2] < 500 else "server_error"
                return JSONResponse({"error": {"message": end[1], "type": kind, "param": None, "code": None}},
                                    status_code=end[2])
            _, reason, n, stats = end
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    "usage": self._usage(job, n), "jaxspec": stats}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, chat=True)

        return app

    async def _sse(self, job, events, head, chat):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(piece, reason=None, first=False, **extra):
            if chat:
                delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
            return f"data: {json.dumps({**head, 'object': obj, 'choices': [choice], **extra})}\n\n"

        try:
            first = True
            while True:
                ev = await events.get()
                if ev[0] == "text":
                    if ev[1]:
                        yield chunk(ev[1], first=first)
                        first = False
                    continue
                if ev[0] == "error":
                    yield f"data: {json.dumps({'error': {'message': ev[1], 'type': 'server_error'}})}\n\n"
                else:
                    _, reason, n, stats = ev
                    yield chunk("", reason, first=first, usage=self._usage(job, n), jaxspec=stats)
                yield "data: [DONE]\n\n"
                return
        finally:  # also when the client went away: the worker drops the job at its next chunk
            job.cancelled.set()


def serve(server: Server, host: str, port: int, announce=None) -> None:
    import uvicorn

    config = uvicorn.Config(server.app(), host=host, port=port, log_level="warning")
    srv = uvicorn.Server(config)
    if announce is not None:
        async def started():
            while not srv.started:
                await asyncio.sleep(0.05)
            announce()
        async def main():
            await asyncio.gather(srv.serve(), started())
        asyncio.run(main())
    else:
        srv.run()
