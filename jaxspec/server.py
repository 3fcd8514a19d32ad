"""`jaxspec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra).

    POST /v1/completions, POST /v1/chat/completions   (`stream: true` for server-sent events)
    GET /v1/models, GET /health

Requests run one at a time, in arrival order, each as `streaming.stream_generate` on a worker
thread, so a request's output is exactly what `jaxspec generate` gives it (greedy: the CLI's text).
Between its rounds the worker reads the tokens, stops at a stop string, and drops a request whose
client went away. Bad requests get OpenAI's error JSON with a 4xx status before anything runs.
Responses carry `usage` and a `jaxspec` object (mode, K, acceptance, tokens per round).
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import sampling, streaming
from .tokenizer import IncrementalDecoder, TokenizerError


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


@dataclass
class Job:
    """One request, validated: the prompt ids and the generation arguments."""
    ids: list[int]
    max_tokens: int
    stop: list[str]
    kw: dict
    cancelled: threading.Event = field(default_factory=threading.Event)


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
    """The models, the tokenizer and the one worker; `app()` is the FastAPI application."""

    def __init__(self, target, assistant, tokenizer, *, model_name: str, block_size: int = 4,
                 rounds_per_chunk: int = 1):
        self.target, self.assistant, self.tok = target, assistant, tokenizer
        self.model_name, self.block_size, self.rounds_per_chunk = model_name, block_size, rounds_per_chunk
        self.context = target.config.max_position_embeddings
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxspec-serve")
        self.active = 0
        self.waiting = 0
        self.dropped = 0  # requests stopped because their client went away

    def warm_up(self) -> float:
        """Compile what the most common request needs (a short prompt, the smallest budget, greedy)
        before the first client waits for it; other shapes compile on their first request. Seconds."""
        t0 = time.perf_counter()
        ids = (self.tok.encode("Hello") or [1])[:8]
        for _ in streaming.stream_generate(self.target, [ids], assistant=self.assistant, max_new_tokens=16,
                                           block_size=self.block_size, eos_token_ids=self.tok.eos_token_ids):
            pass
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

    # ---- running a job ------------------------------------------------------------------------
    def run(self, job: Job, emit) -> None:
        """On the worker: generate, calling `emit(("text", piece))` as text becomes final and
        `emit(("end", finish_reason, n_tokens, stats))` last (`("error", message, status)` on failure)."""
        self.waiting -= 1
        if job.cancelled.is_set():  # its client left while it waited
            self.dropped += 1
            return
        self.active += 1
        try:
            dec, text, held, n, stats = IncrementalDecoder(self.tok), "", 0, 0, None
            keep = max((len(s) for s in job.stop), default=1) - 1  # a stop string may still be forming
            reason = "length"
            for chunk in streaming.stream_generate(self.target, [job.ids], rounds_per_chunk=self.rounds_per_chunk,
                                                   **job.kw):
                if job.cancelled.is_set():
                    self.dropped += 1
                    return
                new = chunk.tokens[0]
                n += len(new)
                if new and new[-1] in self.tok.eos_token_ids:
                    reason = "stop"
                text += dec.push(new) if not chunk.done else dec.push(new) + dec.flush()
                cut = min((i for i in (text.find(s) for s in job.stop) if i >= 0), default=-1)
                if cut >= 0:
                    emit(("text", text[held:cut]))
                    emit(("end", "stop", n, None))
                    return
                safe = len(text) if chunk.done else max(held, len(text) - keep)
                if safe > held:
                    emit(("text", text[held:safe]))
                    held = safe
                stats = chunk.result.stats if chunk.done else None
            emit(("end", reason, n, stats))
        except ValueError as e:  # input the library refused (e.g. a KV cache beyond the device's memory)
            emit(("error", str(e), 400))
        except Exception as e:  # an internal failure: the request ends with an error, the server keeps serving
            emit(("error", f"{type(e).__name__}: {e}", 500))
        finally:
            self.active -= 1

    def submit(self, job: Job) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self.waiting += 1
        self.worker.submit(self.run, job, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        return events

    # ---- responses ------------------------------------------------------------------------------
    def _extension(self, stats) -> dict | None:
        if stats is None:
            return None
        return {"mode": stats.mode, "block_size": stats.block_size, "acceptance_rate": stats.acceptance_rate,
                "tokens_per_round": stats.tokens_per_round, "rounds": stats.rounds, "fallback": stats.fallback}

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
                    "usage": self._usage(job, n), "jaxspec": self._extension(stats)}

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
                    yield chunk("", reason, first=first, usage=self._usage(job, n), jaxspec=self._extension(stats))
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
