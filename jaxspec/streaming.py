"""Streaming generation: tokens reach the host as rounds complete.

    for chunk in jaxspec.streaming.stream_generate(target, prompt_ids, assistant=assistant):
        print(tok.decode(chunk.tokens[0]), end="", flush=True)
    result = chunk.result          # the last chunk carries the GenerationResult (tokens + stats)

A host loop over the programs `jaxspec.generate` runs: the same prefill, then the same compiled
decode (`Generator.compiled_decode`), called with a round budget of `rounds_per_chunk` instead of
the whole budget and again on the state it returns, reading the newly committed tokens in between.
The decode state has the same shapes before and after every call, so all chunks run one program.
The rounds, and the sampling key threaded through them, are the ones `generate` runs, so the
streamed tokens equal `generate`'s for the same arguments and seed, greedy or sampled.

Cost: one dispatch and one device-to-host read per chunk; raise `rounds_per_chunk` to amortize it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Sequence

import jax

from .generate import GenerationResult, plan
from .loop import check_prefill


@dataclasses.dataclass
class StreamChunk:
    """New tokens of one chunk: `tokens[b]` lists row b's tokens committed since the previous chunk
    (possibly empty: the row is done). `rounds` counts the rounds run so far. `done` on the last
    chunk, which also carries `result` (what `jaxspec.generate` returns, timings included)."""

    tokens: list[list[int]]
    rounds: int
    done: bool
    result: GenerationResult | None = None


def stream_generate(target, prompt_ids, *, assistant=None, max_new_tokens: int = 128, block_size: int = 4,
                    temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                    eos_token_ids: Sequence[int] | None = None, stop_token_ids: Sequence[int] = (),
                    verify_pad=None, draft: str = "sample", cache_size: int | None = None,
                    exactness_probe: bool = True, rounds_per_chunk: int = 1) -> Iterator[StreamChunk]:
    """`jaxspec.generate` as an iterator of StreamChunks (same arguments, output and stats). Input
    errors raise here, as does the exactness probe's fallback (it runs here); the prefill and
    decode compile on the first `next()`. The first chunk holds the first token (from prefill),
    then one chunk per `rounds_per_chunk` rounds; the last has `done=True` and `result`. Stopping
    the iteration early abandons the generation."""
    if isinstance(rounds_per_chunk, bool) or not isinstance(rounds_per_chunk, int) or rounds_per_chunk < 1:
        raise ValueError(f"rounds_per_chunk must be an integer >= 1, got {rounds_per_chunk!r}")
    p = plan(target, prompt_ids, assistant=assistant, max_new_tokens=max_new_tokens, block_size=block_size,
               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_ids=eos_token_ids,
               stop_token_ids=stop_token_ids, verify_pad=verify_pad, draft=draft, cache_size=cache_size,
               exactness_probe=exactness_probe)
    return _stream(p, target, rounds_per_chunk)


def _read(state, seen):
    """(new tokens per row since `seen`, the new counts, all rows done, rounds so far)."""
    out, n_out, done, rounds = jax.device_get((state.out, state.n_out, state.done, state.rounds))
    new = [out[b, seen[b]:n].tolist() for b, n in enumerate(n_out.tolist())]
    return new, n_out.tolist(), bool(done.all()), int(rounds)


def _stream(p, target, rounds_per_chunk: int) -> Iterator[StreamChunk]:
    gen = p.gen
    prefill = gen.compiled_prefill(target, *p.inputs)
    t0 = time.perf_counter()
    state = jax.block_until_ready(prefill())
    prefill_s = time.perf_counter() - t0
    check_prefill(state)
    decode = gen.compiled_decode(target, p.drafter, state)

    pending, seen, all_done, rounds = _read(state, [0] * p.batch)
    decode_s = 0.0
    # Every round emits >= 1 token per active row, so max_new_tokens rounds finish every row; the
    # bound only keeps a broken loop from spinning forever.
    while not all_done and rounds < gen.spec.max_new_tokens:
        yield StreamChunk(tokens=pending, rounds=rounds, done=False)
        t0 = time.perf_counter()
        state = decode(state, rounds_per_chunk)
        pending, seen, all_done, rounds = _read(state, seen)
        decode_s += time.perf_counter() - t0
    yield StreamChunk(tokens=pending, rounds=rounds, done=True, result=p.result(state, prefill_s, decode_s))


def generate_streaming(target, prompt_ids, *, on_tokens: Callable[[list[list[int]]], None], **kwargs) -> GenerationResult:
    """Run `stream_generate` to the end, calling `on_tokens(new_tokens_per_row)` for every chunk
    with tokens in it; returns the GenerationResult. (HF's `streamer=` style.)"""
    result = None
    for chunk in stream_generate(target, prompt_ids, **kwargs):
        if any(chunk.tokens):
            on_tokens(chunk.tokens)
        result = chunk.result
    return result
