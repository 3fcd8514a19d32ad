"""Streaming generation: tokens reach the host as rounds complete.

    for chunk in jaxspec.engine.streaming.stream_generate(target, prompt_ids, assistant=assistant):
        print(tok.decode(chunk.tokens[0]), end="", flush=True)
    result = chunk.result          # the last chunk carries the GenerationResult (tokens + stats)

A host loop over generate's prefill and its round (`loop.decode_round`): each chunk is one call of
a program of exactly `rounds_per_chunk` rounds (`Generator.compiled_rounds`), on the state the last
call returned (the same shapes every time: one program for all chunks). The rounds, and the sampling
key threaded through them, are the ones `generate` runs, so the streamed tokens and stats equal
`generate`'s for the same arguments and seed, greedy or sampled.

Pipelined: the next chunk is queued before the last one is read, so the host's read and the
caller's work on a chunk overlap the device (a program with no early exit returns once queued; the
decode loop's exit test would make every call wait for its rounds). It costs one chunk of rounds
after the last row is done, and stats' decode seconds count the time spent inside the iterator.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Sequence

import jax

from jaxspec.engine.generate import MAX_ROUNDS_PER_CHUNK, GenerationResult, check_int, plan, request_of
from jaxspec.engine.loop import Snapshot, check_prefill, snapshot


@dataclasses.dataclass
class StreamChunk:
    """New tokens of one chunk: `tokens[b]` lists row b's tokens committed since the previous chunk
    (possibly empty: the row is done). `rounds` counts the rounds run so far. `done` on the last
    chunk, which also carries `result` (what `jaxspec.generate` returns, timings included).
    `logprobs[b]` (with `logprobs=N`): the new tokens' entries of GenerationResult.logprobs."""

    tokens: list[list[int]]
    rounds: int
    done: bool
    result: GenerationResult | None = None
    logprobs: list[list[tuple]] | None = None


def stream_generate(target, prompt_ids, *, assistant=None, params=None, block_size: int = 4,
                    eos_token_ids: Sequence[int] | None = None, verify_pad=None, cache_size: int | None = None,
                    exactness_probe: bool = True, rounds_per_chunk: int = 1, drafter=None, n: int = 1,
                    **knobs) -> Iterator[StreamChunk]:
    """`jaxspec.generate` as an iterator of StreamChunks (same arguments, output and stats: the
    request as `params` or its keywords). Input errors raise here, as does the exactness probe's
    fallback (it runs here); the prefill and decode compile on the first `next()`. The first chunk
    holds the first token (from prefill), then one chunk per `rounds_per_chunk` rounds; the last
    has `done=True` and `result`. Stopping the iteration early abandons the generation.
    `rounds_per_chunk`: 1..MAX_ROUNDS_PER_CHUNK (64)."""
    rounds_per_chunk = check_int("rounds_per_chunk", rounds_per_chunk, 1, MAX_ROUNDS_PER_CHUNK)
    p = plan(target, prompt_ids, request_of(params, **knobs), assistant=assistant, block_size=block_size,
             eos_token_ids=eos_token_ids, verify_pad=verify_pad, cache_size=cache_size,
             exactness_probe=exactness_probe, rounds_per_chunk=rounds_per_chunk, drafter=drafter, n=n)
    return _stream(p, target, rounds_per_chunk)


def _stream(p, target, rounds_per_chunk: int) -> Iterator[StreamChunk]:
    gen = p.gen
    prefill = gen.compiled_prefill(target, *p.inputs)
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill())
    prefill_s = time.perf_counter() - t0
    check_prefill(state)
    chunk = gen.compiled_rounds(target, p.params, state, rounds_per_chunk)

    t0 = time.perf_counter()
    seen = [0] * p.batch
    window = rounds_per_chunk * gen.spec.block_size + 1  # tokens a row gains per call, at most
    snap = snapshot(state, window)
    decode_s = 0.0
    # Every round emits >= 1 token per active row, so max_new_tokens rounds finish every row; the
    # bound only keeps a broken loop from spinning forever.
    calls = -(-gen.spec.max_new_tokens // rounds_per_chunk) + 1
    for i in range(calls):
        state = chunk(state)  # queued: runs while the last snapshot is read and handed out
        nxt = snapshot(state, window)
        got = Snapshot.of(snap)
        pending = [got.tokens(b, seen[b], n) for b, n in enumerate(got.n_out.tolist())]
        lps = None if got.lps is None else [got.logprobs(b, seen[b], n) for b, n in enumerate(got.n_out.tolist())]
        seen, rounds = got.n_out.tolist(), int(got.row_rounds.max())
        if got.done.all() or i == calls - 1:
            break
        decode_s += time.perf_counter() - t0
        yield StreamChunk(tokens=pending, rounds=rounds, done=False, logprobs=lps)
        t0 = time.perf_counter()
        snap = nxt
    state = jax.block_until_ready(state)
    decode_s += time.perf_counter() - t0
    yield StreamChunk(tokens=pending, rounds=rounds, done=True, result=p.result(state, prefill_s, decode_s),
                      logprobs=lps)


def generate_streaming(target, prompt_ids, *, on_tokens: Callable[[list[list[int]]], None], **kwargs) -> GenerationResult:
    """Run `stream_generate` to the end, calling `on_tokens(new_tokens_per_row)` for every chunk
    with tokens in it; returns the GenerationResult. (HF's `streamer=` style.)"""
    result = None
    for chunk in stream_generate(target, prompt_ids, **kwargs):
        if any(chunk.tokens):
            on_tokens(chunk.tokens)
        result = chunk.result
    return result
