"""`jaxspec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra).

    POST /v1/completions, POST /v1/chat/completions   (`stream: true` for server-sent events)
    GET /v1/models, GET /health

Requests decode together, continuously batched (`jaxspec.batching.BatchEngine`): one worker thread
admits waiting requests into free slots between rounds (in arrival order), runs a round for every
live slot, and retires finished ones. Every sampling setting shares the batch: temperature, top_p,
top_k, seed, logit_bias and logprobs are per-row values of one engine, so a new setting compiles
nothing. A request whose prompt and budget do not fit a slot is refused once the server has
warmed up (a 400 naming the slot's limit: it would compile programs on the serving path while
every other client waits); without the warm-up it runs alone (`streaming.stream_generate`) once
the batch has drained. Either way its output is exactly what
`jaxspec generate` gives it (greedy: the CLI's text; sampled: the same for the same seed on CPU;
on a GPU the same distribution, see `jaxspec.batching`). Between
rounds the worker reads the tokens, stops at a stop string, and drops a request whose client went
away (streaming or not). Bad requests get OpenAI's error JSON with a 4xx status before anything
runs; a field the server does not implement is a 400 naming it, never ignored. Responses carry
`usage` and a `jaxspec` object (mode, K, acceptance, tokens per round, batch slots). In front of
the app, `serve_guard.Guard` checks the API key, Host, CORS, content type and body size.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from . import compile_cache, sampling, serve_guard, streaming
from .batching import BatchEngine
from .serve_guard import Guard, error_json
from .generate import BUDGET_BUCKET, MAX_ROUNDS_PER_CHUNK, check_block_size, check_int
from .tokenizer import IncrementalDecoder, TokenizerError

log = logging.getLogger(__name__)  # the warm-up's request (jaxspec serve shows INFO lines)
BATCH_CONTEXT = 4096  # cache positions per slot at most (longer requests: refused after the warm-up)
DISCONNECT_POLL_S = 0.25  # a waiting non-streaming request checks this often whether its client left
LARGE_BODY = 64 << 10  # a body past this many bytes (or of unknown length) is a large one
MAX_LARGE_BODIES = 4   # large bodies read and parsed at once; more wait (unread: the client's TCP window)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return error_json(self.message, code=self.code, param=self.param)


@dataclass
class Job:
    """One request, validated: the prompt ids, its budget, stop strings and sampling; `emit` (set
    when it is submitted) sends its events to the request's handler."""
    ids: list[int]
    max_tokens: int
    stop: list[str]
    params: sampling.SamplingParams
    seed: int
    logprobs: int | None = None  # alternatives per token to report, or None: no logprobs
    cancelled: threading.Event = field(default_factory=threading.Event)
    emit: object = None


def _fail(job: Job, e: Exception) -> None:
    """End a job with an error: 400 for input the library refused (a ValueError, e.g. a KV cache
    beyond the device's memory), 500 for an internal failure."""
    if isinstance(e, ValueError):
        job.emit(("error", str(e), 400))
    else:
        job.emit(("error", f"{type(e).__name__}: {e}", 500))


class _Text:
    """A job's tokens -> text events: incremental decoding, stop strings (text that may still become
    one is held back), the finish reason, and the tokens' logprob entries (sent with the text that
    holds them; those past a stop string are dropped); `push` returns True once the job has ended.
    Events: ("text", piece, entries) and ("end", reason, n tokens, stats, entries)."""

    def __init__(self, tok, job: Job):
        self.tok, self.job = tok, job
        self.dec, self.text, self.held, self.n, self.reason = IncrementalDecoder(tok), "", 0, 0, "length"
        self.keep = max((len(s) for s in job.stop), default=1) - 1
        self.entries: list[tuple] = []  # (token id, text end offset, logprob, alternatives), not sent yet

    def push(self, new: list[int], done: bool, stats=None, lps=None) -> bool:
        emit = self.job.emit
        self.n += len(new)
        if new and new[-1] in self.tok.eos_token_ids:
            self.reason = "stop"
        if lps is None:
            self.text += self.dec.push(new) + (self.dec.flush() if done else "")
        else:  # token by token, to know where each token's text ends
            for i, (t, (lp, alts)) in enumerate(zip(new, lps)):
                self.text += self.dec.push([t]) + (self.dec.flush() if done and i == len(new) - 1 else "")
                self.entries.append((t, len(self.text), lp, alts))
        cut = min((i for i in (self.text.find(s) for s in self.job.stop) if i >= 0), default=-1)
        if cut >= 0:
            emit(("text", self.text[self.held:cut], self._take(cut, inclusive=True)))
            emit(("end", "stop", self.n, stats, []))
            return True
        safe = len(self.text) if done else max(self.held, len(self.text) - self.keep)
        if safe > self.held:
            emit(("text", self.text[self.held:safe], self._take(safe)))
            self.held = safe
        if done:
            emit(("end", self.reason, self.n, stats, self._take(len(self.text))))
        return done

    def _take(self, upto: int, inclusive: bool = False) -> list[tuple]:
        """The pending entries of tokens whose text ends by `upto` (at a stop string's start: also the
        token that text is cut in)."""
        n = 0
        while n < len(self.entries) and self.entries[n][1] <= upto:
            n += 1
        if inclusive and n < len(self.entries) and (n == 0 or self.entries[n - 1][1] < upto):
            n += 1
        taken, self.entries = self.entries[:n], self.entries[n:]
        if inclusive:
            self.entries = []
        return taken


# ---- validation ------------------------------------------------------------------------------
MAX_STOP_CHARS = 256        # per stop string

# Fields a request may carry; the values that change nothing are accepted for the others
# (`_NEUTRAL`); anything else is a 400 naming the field, never silently ignored.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "n", "logit_bias", "user", "presence_penalty", "frequency_penalty", "logprobs"}
_FIELDS = {False: _COMMON | {"prompt", "echo", "best_of", "suffix"},
           True: _COMMON | {"messages", "top_logprobs", "max_completion_tokens"}}
_NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "echo": (False,), "best_of": (1,),
            "suffix": ("",), "n": (1,)}


def _check_fields(body: dict, chat: bool) -> None:
    for name in body:
        if name not in _FIELDS[chat]:
            raise ApiError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    for name, ok in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and (isinstance(v, bool) != isinstance(ok[0], bool) or v not in ok):
            raise ApiError(400, f"'{name}' is not supported by this server (only {ok[0]!r})", name,
                           "unsupported_parameter")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_usage"}
                                 and isinstance(opts.get("include_usage", True), bool)):
        raise ApiError(400, "'stream_options' may only hold include_usage (a boolean)", "stream_options")


def _number(body, name, default, lo, hi, *, integer=False, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        kind = "an integer" if integer else "a number"
        rng = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be {kind} {rng}, got {str(v)[:40]}", name)
    return v


def _stops(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"'stop' must be a non-empty string of at most {MAX_STOP_CHARS} characters or a list "
                            "of at most 4 of them", "stop")
    return stop


def _logit_bias(body, vocab: int) -> tuple:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
    pairs = []
    for k, v in bias.items():
        t = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 12 else -1
        if not 0 <= t < vocab:
            raise ApiError(400, f"'logit_bias' keys must be token ids in [0, {vocab}), got {k[:40]!r}", "logit_bias")
        pairs.append((t, v))
    try:
        return sampling.validate_bias(pairs)
    except ValueError as e:
        raise ApiError(400, f"'logit_bias': {e}", "logit_bias") from None


def _check_text(body: dict) -> None:
    """400 for a lone surrogate anywhere in the body (JSON's "\\ud800" escape parses to one): no text
    holding one can be encoded as UTF-8, so the tokenizer (and the reply) would fail on it."""
    todo = [(name, v) for name, v in body.items()]
    while todo:
        name, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"'{name}' holds a lone surrogate U+{ord(v[e.start]):04X} at character {e.start}: "
                                    "text must be valid Unicode (UTF-8 encodable)", name) from None
        elif isinstance(v, dict):
            todo += [(name, x) for x in v.values()] + [(name, k) for k in v]
        elif isinstance(v, list):
            todo += [(name, x) for x in v]


def max_token_bytes(tok) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token stands for: the longest vocabulary entry
    (byte-level and SentencePiece entries are at least as long as their text), doubled when the
    tokenizer normalizes text first (a normalizer may shorten it). None when the vocabulary cannot
    be read."""
    try:
        backend = tok.backend
        longest = max(len(t.encode("utf-8", "replace")) for t in backend.get_vocab(with_added_tokens=True))
        return max(1, longest) * (2 if backend.normalizer is not None else 1)
    except Exception:  # a tokenizer without a readable vocabulary: no bound
        return None


def parse_body(raw: bytes):
    """The JSON body; a 400 for anything json cannot read (bad syntax or encoding, a 5000-digit
    integer, nesting past the recursion limit)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


class Server:
    """The models, the tokenizer and the one worker thread; `app()` is the FastAPI application.
    `max_batch`: slots decoding together (continuous batching), any mix of sampling settings in one
    batch; `rounds_per_chunk`: rounds between two reads of the new tokens (and two admissions),
    1..64. The host's ~1.5 ms per chunk overlaps the device's rounds, so a large model loses nothing
    to it (12B: 1 round 183 tokens/s for one client, 4 rounds 173, as the first token waits a longer
    chunk); a small one is bound by it (the default pair: 4 rounds 2,169 tokens/s, 1 round 631).
    Hence 4 by default (docs/benchmark_results/serve-h200-2026-12-02.md). `max_queue`: requests
    waiting for a slot at most; more are answered 429 with Retry-After."""

    def __init__(self, target, assistant, tokenizer, *, model_name: str, block_size: int = 4,
                 rounds_per_chunk: int = 4, max_batch: int = 4, max_queue: int = 64):
        check_int("max_batch", max_batch, 1, 1 << 12)
        check_int("rounds_per_chunk", rounds_per_chunk, 1, MAX_ROUNDS_PER_CHUNK)
        check_int("max_queue", max_queue, 1, 1 << 20)
        check_block_size(block_size, target.config.max_position_embeddings)
        self.target, self.assistant, self.tok = target, assistant, tokenizer
        self.model_name, self.block_size, self.rounds_per_chunk = model_name, block_size, rounds_per_chunk
        self.max_batch, self.max_queue = max_batch, max_queue
        self.context = target.config.max_position_embeddings
        # per slot: the context (at most BATCH_CONTEXT positions), half of it for the budget
        self.batch_capacity = min(self.context or BATCH_CONTEXT, BATCH_CONTEXT)
        self.batch_tokens = max(1, self.batch_capacity // 2 // BUDGET_BUCKET * BUDGET_BUCKET)
        self._engine: BatchEngine | None = None  # built on first use (warm_up or the first request)
        self.slots: dict[int, tuple[Job, _Text]] = {}
        self.queue: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.solo = 0
        self.dropped = 0  # requests stopped because their client went away
        self.served = 0
        self.compiles = compile_cache.CompileLog().__enter__()  # programs built (/health), emptied by warm_up
        self.prep = ThreadPoolExecutor(1, thread_name_prefix="jaxspec-tokenize")  # off the event loop
        # Text past context x this many bytes cannot fit: refused before the tokenizer sees it (64
        # concurrent 1 MB prompts, all tokenized, froze /health for 14.8 s: issue 51).
        self.token_bytes = max_token_bytes(tokenizer)
        self.slot_room = None  # after warm_up: prompt length -> the largest budget a slot takes
        threading.Thread(target=self._work, name="jaxspec-serve", daemon=True).start()

    @property
    def active(self) -> int:
        return len(self.slots) + self.solo

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def engine(self) -> BatchEngine:
        """The one batch engine: every sampling setting runs in it (greedy, sampled, filtered, with
        a bias or logprobs), so a new setting compiles nothing."""
        if self._engine is None:
            self._engine = BatchEngine(
                self.target, self.assistant, slots=self.max_batch, max_new_tokens=self.batch_tokens,
                capacity=self.batch_capacity, block_size=self.block_size, eos_token_ids=self.tok.eos_token_ids,
                rounds_per_step=self.rounds_per_chunk)
        return self._engine

    def warm_up(self) -> float:
        """Compile every program a request that fits a slot runs (each of the engine's step programs,
        the prefill of a short prompt), before the first client waits for it; then count what is
        built later (/health's "compiles": a longer prompt's prefill, a request that runs alone).
        Seconds."""
        t0 = time.perf_counter()
        engine = self.engine
        engine.warm_up()  # the step programs of every sampling mode, a short prompt's prefill
        # One request through, and one cancelled: the small programs around them (insert, snapshot,
        # retire), the same whatever the request's sampling.
        ids = (self.tok.encode("Hello") or [1])[:8]
        budget = min(2 * engine.block_size * self.rounds_per_chunk + 2, self.batch_tokens)
        t1 = time.perf_counter()  # each step runs every slot: minutes at --max-batch 1024 on a CPU
        log.info("warm-up: one request through %d slots ...", engine.slots)
        engine.admit(ids, budget, seed=0)
        while engine.live:
            engine.step()
        engine.step()  # the idle step after the last report
        engine.cancel(engine.admit(ids, budget, seed=0))
        log.info("warm-up request took %.1f s", time.perf_counter() - t1)
        self.compiles.programs.clear()
        self.slot_room = engine.room  # from now on a request that fits no slot is refused
        return time.perf_counter() - t0

    # ---- requests -> jobs ------------------------------------------------------------------------
    def job(self, raw: bytes, chat: bool) -> tuple[Job, bool]:
        """A request body -> (its Job, stream); ApiError for anything wrong, before any compute."""
        body = parse_body(raw)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        _check_fields(body, chat)
        _check_text(body)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{str(model)[:100]}' does not exist: this server serves "
                                f"'{self.model_name}'", "model", "model_not_found")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", "stream")
        temperature = _number(body, "temperature", 0.0, 0.0, 2.0)
        if 0 < temperature < sampling.MIN_TEMPERATURE:
            raise ApiError(400, f"'temperature' must be 0 (greedy) or in [{sampling.MIN_TEMPERATURE}, 2]",
                           "temperature")
        top_p = _number(body, "top_p", None, 0.0, 1.0, lo_open=True)
        top_k = _number(body, "top_k", None, 1, 1 << 30, integer=True)
        seed = _number(body, "seed", None, 0, 2**64 - 1, integer=True)
        logprobs = self._logprobs(body, chat)
        bias = _logit_bias(body, self.target.config.vocab_size)
        stop = _stops(body)
        try:
            params = sampling.SamplingParams(temperature=float(temperature), top_k=top_k, top_p=top_p,
                                             logit_bias=bias)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        ids = self._chat_ids(body) if chat else self._prompt_ids(body)
        what = "messages" if chat else "prompt"
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", what)
        room = None if self.context is None else self.context - len(ids)
        if room is not None and room < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, longer than the model's context of "
                                f"{self.context} tokens", what, "context_length_exceeded")
        default = 256 if chat else 16  # completions: OpenAI's default; chat: a bounded stand-in for "the rest"
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        slot = None if self.slot_room is None else self.slot_room(len(ids))
        if slot is not None and slot < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, more than a batch slot of this server holds "
                                f"({self.batch_capacity} positions for prompt and output)", what, "exceeds_batch_slot")
        default = min(default, room or default, slot or default)
        max_tokens = _number(body, name, default, 1, room or 1 << 20, integer=True)
        if slot is not None and max_tokens > slot:
            # Running it alone would compile its programs while every other client waits.
            raise ApiError(400, f"'{name}' {max_tokens} does not fit a batch slot of this server: with this "
                                f"{len(ids)}-token prompt at most {slot} (at most {self.batch_tokens} new tokens "
                                f"and {self.batch_capacity} positions per request)", name, "exceeds_batch_slot")
        if seed is None:  # as OpenAI: without a seed, sampling differs from call to call
            seed = random.getrandbits(63)
        return Job(ids=ids, max_tokens=max_tokens, stop=stop, params=params, seed=seed, logprobs=logprobs), stream

    @staticmethod
    def _logprobs(body, chat: bool) -> int | None:
        """Alternatives per token to report, or None. Completions: `logprobs` N; chat: `logprobs`
        true with `top_logprobs` N."""
        top = sampling.TOP_LOGPROBS
        if not chat:
            return _number(body, "logprobs", None, 0, top, integer=True)
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise ApiError(400, "'logprobs' must be a boolean", "logprobs")
        n = _number(body, "top_logprobs", None, 0, top, integer=True)
        if n is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (n or 0) if on else None

    def _check_length(self, texts, what: str) -> None:
        """400 for text more bytes long than a context-full of the longest tokens: it cannot fit, and
        is refused without tokenizing it."""
        if self.token_bytes is None or self.context is None:
            return
        n = sum(len(t.encode("utf-8")) for t in texts)
        if n > self.context * self.token_bytes:
            raise ApiError(400, f"the {what} is {n} bytes of text, more than the model's context of {self.context} "
                                f"tokens can hold (a token stands for at most {self.token_bytes} bytes)", what,
                           "context_length_exceeded")

    def _prompt_ids(self, body) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_length([prompt], "prompt")
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
        for i, m in enumerate(messages):
            extra = sorted(set(m) - {"role", "content"})
            if extra:  # a field the template never sees: dropping it would change the conversation silently
                raise ApiError(400, f"'messages[{i}]' has {', '.join(repr(k[:40]) for k in extra[:5])}, which this "
                                    "server does not use (only role and content)", "messages",
                               "unsupported_parameter")
        self._check_length([m["content"] for m in messages] + [m["role"] for m in messages], "messages")
        try:
            return self.tok.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
        except TokenizerError as e:
            raise ApiError(400, f"this model cannot chat: {e}", "messages") from None

    # ---- running jobs: the worker thread ------------------------------------------------------------
    def submit(self, job: Job) -> asyncio.Queue:
        """Queue a job; 429 (with Retry-After) when max_queue requests already wait."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job.emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        with self.cond:
            if len(self.queue) >= self.max_queue:
                wait = 1 + len(self.queue) // self.max_batch
                raise ApiError(429, f"{len(self.queue)} requests are waiting (--max-queue {self.max_queue}): retry "
                                    f"in {wait} s", code="queue_full", headers={"Retry-After": str(wait)})
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
                else:  # only cancelled jobs were waiting, or the next one waits for the batch to drain
                    time.sleep(0.001)
            except Exception as e:  # an internal failure: its requests end with an error, the server keeps serving
                for job, _ in self.slots.values():
                    job.emit(("error", f"{type(e).__name__}: {e}", 500))
                self.slots.clear()
                self._engine = None

    def _admit(self) -> Job | None:
        """Admit waiting jobs in arrival order into free slots; returns a job that must run alone
        (it fits no slot) once the batch has drained."""
        while self.queue:
            job = self.queue[0]
            if job.cancelled.is_set():  # its client left while it waited
                with self.cond:
                    self.queue.popleft()
                self.dropped += 1
                continue
            try:
                engine = self.engine
            except Exception as e:  # e.g. its cache does not fit the device: this request fails, not the server
                with self.cond:
                    self.queue.popleft()
                _fail(job, e)
                continue
            if not engine.fits(len(job.ids), job.max_tokens):
                if self.slots:
                    return None  # runs alone once the batch has drained
                with self.cond:
                    return self.queue.popleft()
            if not engine.free:
                return None
            with self.cond:
                self.queue.popleft()
            try:
                slot = engine.admit(job.ids, job.max_tokens, seed=job.seed, owner=job, params=job.params,
                                    logprobs=job.logprobs)
            except Exception as e:  # e.g. a refused request (400), a prefill that failed to build (500)
                _fail(job, e)
                continue
            self.slots[slot] = (job, _Text(self.tok, job))
        return None

    def _round(self) -> None:
        engine = self.engine
        for ev in engine.step():
            job, text = self.slots[ev.slot]
            if ev.error is not None:  # e.g. non-finite logits from the prompt: this request fails
                job.emit(("error", ev.error, 400))
                del self.slots[ev.slot]
                continue
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
            if text.push(ev.tokens, ev.done, stats, ev.logprobs):
                if not ev.done:  # a stop string ended it early
                    engine.cancel(ev.slot)
                del self.slots[ev.slot]
                self.served += 1

    def _run_alone(self, job: Job) -> None:
        """A job no slot fits (prompt + budget past a slot's cache), alone with stream_generate."""
        self.solo += 1
        try:
            text = _Text(self.tok, job)
            p = job.params
            for chunk in streaming.stream_generate(
                    self.target, [job.ids], assistant=self.assistant, max_new_tokens=job.max_tokens,
                    block_size=self.block_size, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                    logit_bias=p.logit_bias, logprobs=job.logprobs, seed=job.seed,
                    eos_token_ids=self.tok.eos_token_ids, rounds_per_chunk=self.rounds_per_chunk):
                if job.cancelled.is_set():
                    self.dropped += 1
                    return
                s = chunk.result.stats if chunk.done else None
                stats = None if s is None else {
                    "mode": s.mode, "block_size": s.block_size, "acceptance_rate": s.acceptance_rate,
                    "tokens_per_round": s.tokens_per_round, "rounds": s.rounds, "fallback": s.fallback,
                    "batch_slots": 1}
                lps = None if chunk.logprobs is None else chunk.logprobs[0]  # job.logprobs alternatives each
                if text.push(chunk.tokens[0], chunk.done, stats, lps):
                    self.served += 1
                    return
        except Exception as e:  # the request ends with an error, the server keeps serving
            _fail(job, e)
        finally:
            self.solo -= 1

    # ---- responses ------------------------------------------------------------------------------
    def _usage(self, job, n):
        return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n}

    def _logprobs_json(self, entries, chat: bool, offset: int = 0):
        """OpenAI's logprobs object for `entries` [(id, text end, logprob, [(id, logprob), ...])]:
        chat's {"content": [...]}, completions' parallel lists (text_offset from `offset`)."""
        piece = lambda t: self.tok.decode([t], skip_special_tokens=False)  # noqa: E731
        if chat:
            def item(t, lp):
                s = piece(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            return {"content": [item(t, lp) | {"top_logprobs": [item(a, alp) for a, alp in alts]}
                                for t, _, lp, alts in entries], "refusal": None}
        tokens = [piece(t) for t, _, _, _ in entries]  # each decoded once: offsets and strings
        offsets, at, tops = [], offset, []
        for s, (_, _, _, alts) in zip(tokens, entries):
            offsets.append(at)
            at += len(s)
            top: dict = {}
            for a, alp in alts:  # most likely first: a string two byte tokens share keeps the larger
                top.setdefault(piece(a), alp)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [lp for _, _, lp, _ in entries], "top_logprobs": tops,
                "text_offset": offsets}

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

        @app.get("/v1/models")
        async def models_():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "jaxspec"}]}

        large = asyncio.Semaphore(MAX_LARGE_BODIES)

        async def handle(request: Request, chat: bool):
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
                job, stream = await asyncio.get_running_loop().run_in_executor(self.prep, self.job, raw, chat)
            head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                    "model": self.model_name}
            events = self.submit(job)
            if stream:
                return StreamingResponse(self._sse(job, events, head, chat), media_type="text/event-stream")
            text, entries, end = "", [], None
            clock = asyncio.get_running_loop().time
            check = clock() + DISCONNECT_POLL_S
            while end is None:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    ev = None
                if clock() >= check:  # every poll interval, events or not
                    check = clock() + DISCONNECT_POLL_S
                    if await request.is_disconnected():  # nobody will read the answer: stop its work
                        job.cancelled.set()
                        return JSONResponse({}, status_code=499)
                if ev is None:
                    continue
                if ev[0] == "text":
                    text += ev[1]
                    entries += ev[2]
                else:
                    end = ev
            if end[0] == "error":
                kind = "invalid_request_error" if end[2] < 500 else "server_error"
                return JSONResponse(error_json(end[1], kind=kind), status_code=end[2])
            _, reason, n, stats, rest = end
            entries += rest
            lps = None if job.logprobs is None else self._logprobs_json(entries, chat)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                       "finish_reason": reason}
                      if chat else {"index": 0, "text": text, "logprobs": lps, "finish_reason": reason})
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
        sent = 0  # characters sent (completions' text_offset)

        def chunk(piece, entries, reason=None, first=False, **extra):
            lps = None if job.logprobs is None else self._logprobs_json(entries, chat, sent)
            if chat:
                delta = ({"role": "assistant"} if first else {}) | ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": piece, "logprobs": lps, "finish_reason": reason}
            return f"data: {json.dumps({**head, 'object': obj, 'choices': [choice], **extra})}\n\n"

        try:
            first = True
            while True:
                ev = await events.get()
                if ev[0] == "text":
                    if ev[1] or ev[2]:
                        yield chunk(ev[1], ev[2], first=first)
                        sent += len(ev[1])
                        first = False
                    continue
                if ev[0] == "error":
                    yield f"data: {json.dumps({'error': {'message': ev[1], 'type': 'server_error'}})}\n\n"
                else:
                    _, reason, n, stats, rest = ev
                    yield chunk("", rest, reason, first=first, usage=self._usage(job, n), jaxspec=stats)
                yield "data: [DONE]\n\n"
                return
        finally:  # also when the client went away: the worker drops the job at its next chunk
            job.cancelled.set()


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
