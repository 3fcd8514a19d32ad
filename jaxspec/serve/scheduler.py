"""The server's scheduler: one worker thread runs every request (a `Job`) through one continuously
batched engine (`batching.BatchEngine`): it admits waiting jobs into free slots between rounds (in
arrival order, each once a slot and the KV blocks its prompt and budget need are free), runs a step
for every live slot (the waiting prompts' prefill chunks, then a round for the decoding ones), turns
each slot's tokens into text events (`_Text`: incremental decoding, stop strings, logprobs) and
retires finished or abandoned jobs (their blocks go back to the pool at once). Every request runs in
the batch: one that fits no slot (longer than a request's capacity or the whole pool) is refused
with a 400. The events (`TextEvent`, `EndEvent`, `ErrorEvent`) go to the job's `emit`;
`jaxspec.serve.app` turns them into responses, and a full queue (`QueueFull`) into a 429.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from jaxspec.engine import compile_cache, sampling
from jaxspec.engine.batching import BatchEngine
from jaxspec.engine.loop_config import PROMPT_BUCKET, round_up
from jaxspec.serve.config import ServeConfig
from jaxspec.serve.metrics import Metrics
from jaxspec.serve.protocol import capacity_note
from jaxspec.text.tokenizer import IncrementalDecoder

log = logging.getLogger("jaxspec.serve.app")  # the warm-up's request (jaxspec serve shows INFO lines)


class Closed(RuntimeError):
    """A job submitted, or the engine asked for, after `Scheduler.close`."""


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
    arrived: float = 0.0  # perf_counter when submitted (/metrics' time to first token)
    last: float | None = None  # when its last tokens were delivered (None: none yet)


@dataclass(frozen=True)
class TextEvent:
    """More of a job's text, with the logprob entries of the tokens it completes."""
    piece: str
    entries: tuple = ()  # (token id, text end offset, logprob, alternatives) per token


@dataclass(frozen=True)
class EndEvent:
    """A job's end: why ("stop" or "length"), its tokens, the response's `jaxspec` object
    (`stats_json`; None when a stop string cut it) and the last tokens' logprob entries."""
    reason: str
    n_tokens: int
    stats: dict | None
    entries: tuple = ()


@dataclass(frozen=True)
class ErrorEvent:
    """A job ended by a failure: the message and the HTTP status it is answered with (400: the
    library refused the input, 500: an internal failure)."""
    message: str
    status: int


class QueueFull(Exception):
    """`Scheduler.submit` refused a job (not queued): `waiting` jobs already wait, the `limit`
    (max_queue); `retry_after`: seconds until a slot may free (one per batch of waiting jobs)."""

    def __init__(self, waiting: int, limit: int, retry_after: int):
        super().__init__(f"{waiting} jobs are waiting (max_queue {limit}): retry in {retry_after} s")
        self.waiting, self.limit, self.retry_after = waiting, limit, retry_after


def _fail(job: Job, e: Exception) -> None:
    """End a job with an error: 400 for input the library refused (a ValueError, e.g. a KV cache
    beyond the device's memory), 500 for an internal failure."""
    if isinstance(e, ValueError):
        job.emit(ErrorEvent(str(e), 400))
    else:
        job.emit(ErrorEvent(f"{type(e).__name__}: {e}", 500))


class _Text:
    """A job's tokens -> text events: incremental decoding, stop strings (text that may still become
    one is held back), the finish reason, and the tokens' logprob entries (sent with the text that
    holds them; those past a stop string are dropped); `push` returns True once the job has ended,
    its events a `TextEvent` per piece, then an `EndEvent`."""

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
            emit(TextEvent(self.text[self.held:cut], self._take(cut, inclusive=True)))
            emit(EndEvent("stop", self.n, stats))
            return True
        safe = len(self.text) if done else max(self.held, len(self.text) - self.keep)
        if safe > self.held:
            emit(TextEvent(self.text[self.held:safe], self._take(safe)))
            self.held = safe
        if done:
            emit(EndEvent(self.reason, self.n, stats, self._take(len(self.text))))
        return done

    def _take(self, upto: int, inclusive: bool = False) -> tuple:
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
        return tuple(taken)


def stats_json(*, block_size: int, drafted: int, accepted: int, n: int, rounds: int, fallback, slots: int,
               drafter: str | None = None) -> dict:
    """The response's `jaxspec` object (one request's decoding): mode, K, the drafter that ran,
    acceptance, tokens per round (the prefill's token excluded), rounds, why speculation fell back,
    batch slots."""
    return {"mode": "speculative" if block_size > 1 else "classic", "block_size": block_size, "drafter": drafter,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_round": (n - 1) / rounds if rounds else 0.0,
            "rounds": rounds, "fallback": fallback, "batch_slots": slots}


class Scheduler:
    """The models, the one batch engine and the worker thread (started here), run as `config` says
    (a `ServeConfig`): `max_batch` slots decode together; `rounds_per_chunk` rounds between two
    reads of the new tokens (and two admissions); at most `max_queue` jobs wait (`submit` raises
    QueueFull past it). A request holds `batch_capacity` positions and `batch_tokens` new tokens at
    most (`config.request_capacity`, `request_tokens` of the target's context); the slots share a
    pool of `config.kv_pool` cache positions; a step computes `step_tokens` target tokens at most (decode
    first, then `prefill_chunk`-wide chunks of the waiting prompts)."""

    def __init__(self, target, assistant, tok, config: ServeConfig, *, drafter=None):
        self.target, self.assistant, self.tok, self.drafter = target, assistant, tok, drafter
        self.config = config = config.resolved()  # the machine's slots and positions where it names none
        context = target.config.max_position_embeddings
        self.batch_capacity, self.batch_tokens = config.request_capacity(context), config.request_tokens(context)
        self.kv_positions = config.kv_pool(context)
        self._engine: BatchEngine | None = None  # built on first use (warm_up or the first request)
        self.slots: dict[int, tuple[Job, _Text]] = {}
        self.queue: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.dropped = 0  # requests stopped because their client went away
        self.served = 0
        self.metrics = Metrics()  # /metrics: what requests took (the pool's state is read from the engine)
        self.compiles = compile_cache.CompileLog().__enter__()  # programs built (/health), emptied by warm_up
        self.closed = False
        self.worker = threading.Thread(target=self._work, name="jaxspec-serve", daemon=True)
        self.worker.start()

    def close(self) -> None:
        """Stop the worker after its step, drop the engine (its device memory, KV pool and ring
        snapshots, is freed once nothing else holds it) and end the jobs still waiting or running
        with a 503. The worker thread holds the scheduler, so without this a process that builds
        servers one after another (a benchmark sweep) keeps every earlier one's memory. A second
        call does nothing. Not with `cond` held, nor from the worker's thread (a job's `emit`): it
        waits for the worker (RuntimeError there)."""
        if threading.current_thread() is self.worker:
            raise RuntimeError("Scheduler.close from its worker's thread would wait for itself")
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        self.worker.join()
        ended = [*self.queue, *(job for job, _ in self.slots.values())]
        self.queue.clear()
        self.slots.clear()
        self._engine = None
        self.compiles.__exit__(None, None, None)
        for job in ended:
            try:
                job.emit(ErrorEvent("the server is shutting down", 503))
            except RuntimeError:  # its handler's event loop is gone already: nobody reads the answer
                pass

    @property
    def active(self) -> int:
        return len(self.slots)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def engine(self) -> BatchEngine:
        """The one batch engine: every sampling setting runs in it (greedy, sampled, filtered, with
        a bias or logprobs), so a new setting compiles nothing."""
        if self._engine is None:
            if self.closed:
                raise Closed("the server is closed: it has no engine")
            block, c = PROMPT_BUCKET, self.config
            self._engine = BatchEngine(
                self.target, self.assistant, slots=c.max_batch, max_new_tokens=self.batch_tokens,
                capacity=round_up(self.batch_capacity, block), block_size=c.block_size,
                eos_token_ids=self.tok.eos_token_ids, rounds_per_step=c.rounds_per_chunk,
                kv_blocks=max(1, self.kv_positions // block), block_tokens=block, prefill_chunk=c.prefill_chunk,
                step_tokens=c.step_tokens, prefix_cache=c.prefix_cache, ring_snapshots=c.ring_snapshots,
                drafter=self.drafter)
        return self._engine

    def warm_up(self) -> float:
        """Compile every program a request that fits a slot runs (each of the engine's step programs,
        the prefill of a short prompt), before the first client waits for it; then count what is
        built later (/health's "compiles": none are expected, every prompt's chunks run in one program).
        Seconds."""
        t0 = time.perf_counter()
        engine = self.engine
        pool = engine.kv_blocks * engine.block_tokens
        if engine.room(1) < 1:  # no request could ever run: say so now, not in every client's 400
            raise ValueError(f"a KV pool of {pool} positions holds no request: the smallest takes "
                             f"{engine.config.positions(1, 1)} (a 1-token prompt, 1 new token, K = "
                             f"{engine.block_size}): raise --kv-positions")
        engine.warm_up()  # the step programs of every sampling mode, a short prompt's prefill
        # One request through, and one cancelled: the small programs around them (insert, snapshot,
        # retire), the same whatever the request's sampling; its budget fits a small KV pool. One
        # decode step's worth (its prefill's token and a step's rounds) runs every one of them; each
        # more step cost the 270M ~0.4 s of a warm start on a 2-core CPU (two more before).
        ids = (self.tok.encode("Hello") or [1])[:8]
        ids = ids[:max(1, min(len(ids), engine.room(1)))]
        budget = min(engine.block_size * self.config.rounds_per_chunk + 1, self.batch_tokens, engine.room(len(ids)))
        t1 = time.perf_counter()  # each step runs every slot: minutes at --max-batch 1024 on a CPU
        log.info("warm-up: one request through %d slots ...", engine.slots)
        engine.admit(ids, budget, seed=0)
        while engine.live:
            engine.step()
        engine.step()  # the idle step after the last report
        engine.cancel(engine.admit(ids, budget, seed=0))
        log.info("warm-up request took %.1f s", time.perf_counter() - t1)
        self.compiles.programs.clear()
        return time.perf_counter() - t0

    def render_metrics(self) -> str:
        """/metrics' text (`jaxspec.serve.metrics`): the pool's blocks and prefix hits, the queue, the
        batch, tokens and latencies."""
        engine = self._engine  # not built here: /metrics before the first request reads zeros
        return self.metrics.render(pool=None if engine is None else engine.pool, waiting=self.waiting,
                                   running=self.active, served=self.served)

    def submit(self, job: Job) -> asyncio.Queue:
        """Queue a job (its events come on the returned queue); QueueFull, and the job not queued,
        when max_queue jobs already wait."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job.emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        job.arrived = time.perf_counter()
        with self.cond:
            if self.closed:
                raise Closed("the server is shutting down")
            waiting, limit = len(self.queue), self.config.max_queue
            if waiting >= limit:
                raise QueueFull(waiting, limit, retry_after=1 + waiting // self.config.max_batch)
            self.queue.append(job)
            self.cond.notify()
        return events

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.slots and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
            try:
                self._admit()
                if self.slots:
                    self._round()
                else:  # only cancelled or refused jobs were waiting
                    time.sleep(0.001)
            except Exception as e:  # an internal failure: its requests end with an error, the server keeps serving
                for job, _ in self.slots.values():
                    job.emit(ErrorEvent(f"{type(e).__name__}: {e}", 500))
                self.slots.clear()
                if self._engine is not None:
                    self.metrics.retire(self._engine.pool)
                self._engine = None

    def _admit(self) -> None:
        """Admit waiting jobs in arrival order while a slot and their blocks are free (the first
        that must wait holds the others back: no request starves behind shorter ones); a job that
        can never fit (past a request's capacity or the whole pool) ends with a 400."""
        while self.queue:
            job = self.queue[0]
            if job.cancelled.is_set():  # its client left while it waited
                with self.cond:
                    self.queue.popleft()
                self.dropped += 1
                continue
            try:
                engine = self.engine
            except Closed:  # close() ends the waiting jobs once this worker has stopped
                return
            except Exception as e:  # e.g. its cache does not fit the device: this request fails, not the server
                with self.cond:
                    self.queue.popleft()
                _fail(job, e)
                continue
            if not engine.fits(len(job.ids), job.max_tokens):
                with self.cond:
                    self.queue.popleft()
                job.emit(ErrorEvent(f"a {len(job.ids)}-token prompt with max_tokens={job.max_tokens} does not fit "
                                    f"this server: at most {engine.room(len(job.ids))} new tokens for this prompt "
                                    f"({capacity_note(engine.capacity, engine.kv_blocks * engine.block_tokens)})",
                                    400))
                continue
            if not engine.can_admit(len(job.ids), job.max_tokens, job.ids):
                return  # a slot or its KV blocks free up when a running request ends
            with self.cond:
                self.queue.popleft()
            try:
                slot = engine.admit(job.ids, job.max_tokens, seed=job.seed, owner=job, params=job.params,
                                    logprobs=job.logprobs)
            except Exception as e:  # e.g. a refused request (400), a prefill that failed to build (500)
                _fail(job, e)
                continue
            self.slots[slot] = (job, _Text(self.tok, job))

    def _round(self) -> None:
        engine = self.engine
        for slot, (job, _) in list(self.slots.items()):  # gone clients: also mid-prefill, before their chunks run
            if job.cancelled.is_set():
                engine.cancel(slot)
                del self.slots[slot]
                self.dropped += 1
        for ev in engine.step():
            job, text = self.slots[ev.slot]
            if ev.tokens:
                now = time.perf_counter()
                if job.last is None:
                    self.metrics.tokens(len(ev.tokens), first_s=now - job.arrived)
                else:
                    self.metrics.tokens(len(ev.tokens), gap_s=now - job.last)
                job.last = now
            if ev.error is not None:  # e.g. non-finite logits from the prompt: this request fails
                job.emit(ErrorEvent(ev.error, 400))
                del self.slots[ev.slot]
                continue
            if job.cancelled.is_set():
                engine.cancel(ev.slot)
                del self.slots[ev.slot]
                self.dropped += 1
                continue
            stats = None
            if ev.done:
                stats = stats_json(block_size=engine.block_size, drafted=ev.drafted, accepted=ev.accepted,
                                   n=text.n + len(ev.tokens), rounds=ev.rounds, fallback=engine.fallback,
                                   drafter=None if engine.drafter is None else engine.drafter.kind,
                                   slots=engine.slots)
            if text.push(ev.tokens, ev.done, stats, ev.logprobs):
                if not ev.done:  # a stop string ended it early
                    engine.cancel(ev.slot)
                del self.slots[ev.slot]
                self.served += 1
