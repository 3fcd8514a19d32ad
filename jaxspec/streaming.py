"""Streaming generation: tokens reach the host as rounds complete.

    for chunk in jaxspec.streaming.stream_generate(target, prompt_ids, assistant=assistant):
        print(tok.decode(chunk.tokens[0]), end="", flush=True)
    result = chunk.result          # the last chunk carries the GenerationResult (tokens + stats)

Design: a chunked loop on the host. Prefill is `loop.prefill` (the function `jaxspec.generate`
compiles); the decode runs `loop.decode` (the same while loop `jaxspec.generate` runs) for at most
`rounds_per_chunk` rounds per jitted call, resuming from the device state the previous call
returned, and the host reads the newly committed tokens between calls. The per-round arithmetic is
the one `generate` runs, so at temperature 0 the streamed tokens equal `jaxspec.generate`'s
(tests/test_cli.py checks it); the sampling key is threaded through the rounds the same way, so at
T > 0 the same seed gives the same tokens too.

Cost: one dispatch and one device->host sync per chunk (~0.1-0.2 ms on a GPU), against a round
cost of milliseconds for real models; raise `rounds_per_chunk` to amortize it further.

This module builds on generate.py / loop.py internals (`validate_inputs`, `make_generate`,
`Generator.inputs` / `prefill_spec`, `loop.prefill`, `loop.decode`, `generate._result`). If
they change shape it raises `StreamingUnavailable` before the first token, and the CLI falls back to
printing the text at the end (and says so).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from . import loop as L

# `jaxspec.generate` is also the name of the function the package exports, so fetch the module itself.
G = importlib.import_module("jaxspec.generate")


@dataclasses.dataclass
class StreamChunk:
    """New tokens of one chunk: `tokens[b]` lists row b's tokens committed since the previous chunk
    (possibly empty: the row is done or its round was cut). `done` on the last chunk, which also
    carries `result` (the same GenerationResult `jaxspec.generate` returns, timings included)."""

    tokens: list[list[int]]
    rounds: int
    done: bool
    result: G.GenerationResult | None = None


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _decode_chunk(spec: L.LoopSpec, target, assistant, state: L.DecodeState, n_rounds: jax.Array) -> L.DecodeState:
    """Up to `n_rounds` more rounds of `loop.decode` (fewer when every row is done or the loop's
    round guard trips).

    `loop.decode` runs while some row is active and `state.rounds < spec.max_new_tokens`; the round
    counter is only ever incremented by a round, so starting it at `max_new_tokens - budget` makes
    that same loop (preamble and body unchanged) stop after `budget` rounds, and the true count is
    restored afterwards."""
    n = jnp.int32(spec.max_new_tokens)
    real = state.rounds
    budget = jnp.clip(n - real, 0, n_rounds).astype(jnp.int32)
    out = L.decode(spec, target, assistant, state.replace(rounds=n - budget))
    return out.replace(rounds=real + (out.rounds - (n - budget)))


_COMPILED: dict = {}


def _signature(spec, *args):
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (spec, tree, tuple((x.shape, str(x.dtype)) for x in leaves))


def _compile_chunk(spec, target, assistant, state, n_rounds):
    sig = _signature(spec, target, assistant, state, n_rounds)
    fn = _COMPILED.get(sig)
    if fn is None:
        fn = _COMPILED[sig] = _decode_chunk.lower(spec, target, assistant, state, n_rounds).compile()
    return fn


def _settle(spec, target, assistant, state, n_rounds):
    """The state in the shape a chunk leaves it. `loop.decode` sizes some placeholders on entry
    (the accepted-length histogram is empty after prefill and K long after a round); such a
    zero-size leaf carries no data, so it is replaced here by zeros of its decode shape, which
    is what decode does, and every chunk then runs one compiled program. Leaves with data that
    would change shape are left alone (then the first chunk compiles separately)."""
    after = jax.eval_shape(functools.partial(_decode_chunk, spec), target, assistant, state, n_rounds)
    leaves, tree = jax.tree_util.tree_flatten(state)
    new_leaves, new_tree = jax.tree_util.tree_flatten(after)
    if tree != new_tree:
        return state
    out = []
    for x, y in zip(leaves, new_leaves):
        if x.shape != y.shape and x.size == 0 and x.dtype == y.dtype:
            x = jnp.zeros(y.shape, y.dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(tree, out)


def _compiled_chunk(spec, target, assistant, state, n_rounds):
    """`(target, assistant, state, n_rounds) -> state`, compiled ahead of time (no compilation
    between streamed chunks)."""
    _compile_chunk(spec, target, assistant, state, n_rounds)

    def call(t, a, s, n):
        return _compile_chunk(spec, t, a, s, n)(t, a, s, n)

    return call


def stream_generate(target, prompt_ids, *, assistant=None, max_new_tokens: int = 128, block_size: int = 4,
                    temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                    eos_token_ids: Sequence[int] | None = None, stop_token_ids: Sequence[int] = (),
                    verify_pad=None, draft: str = "sample", cache_size: int | None = None,
                    exactness_probe: bool = True, rounds_per_chunk: int = 1) -> Iterator[StreamChunk]:
    """`jaxspec.generate` as an iterator of StreamChunks (same arguments, same validation, same
    exactness probe and fallback, same output). The first chunk holds the first token (from
    prefill); then one chunk per `rounds_per_chunk` rounds; the last one has `done=True` and
    `result`. Compilation happens on the first `next()`; stopping the iteration early abandons the
    generation (the device state is dropped)."""
    if isinstance(rounds_per_chunk, bool) or not isinstance(rounds_per_chunk, int) or rounds_per_chunk < 1:
        raise ValueError(f"rounds_per_chunk must be an integer >= 1, got {rounds_per_chunk!r}")
    _internals()
    rows = G._as_batch(prompt_ids)
    if eos_token_ids is None:
        eos_token_ids = G._default_stop_ids(target)
    pad, stop, capacity, prompt_width = G.validate_inputs(
        target, assistant, rows, max_new_tokens=max_new_tokens, block_size=block_size,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_ids=eos_token_ids,
        stop_token_ids=stop_token_ids, verify_pad=verify_pad, draft=draft, cache_size=cache_size, seed=seed)
    return _stream(target, assistant, rows, pad, stop, capacity, prompt_width, max_new_tokens=max_new_tokens,
                   block_size=block_size, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   draft=draft, exactness_probe=exactness_probe, rounds_per_chunk=rounds_per_chunk)


class StreamingUnavailable(RuntimeError):
    """The generate/loop internals this module builds on have changed shape (see the module
    docstring); callers may fall back to `jaxspec.generate`."""


_PREFILL: list = []


def _prefill_jit():
    if not _PREFILL:
        _PREFILL.append(jax.jit(L.prefill, static_argnums=0))
    return _PREFILL[0]


def _internals():
    """The generate.py / loop.py names streaming relies on, or StreamingUnavailable."""
    names = {"_as_batch": G, "_default_stop_ids": G, "validate_inputs": G, "make_generate": G, "_round_up": G,
             "BUDGET_BUCKET": G, "_result": G, "effective_block_size": G, "decode": L, "prefill": L}
    missing = [f"{mod.__name__}.{n}" for n, mod in names.items() if not hasattr(mod, n)]
    if missing:
        raise StreamingUnavailable("streaming needs " + ", ".join(missing))


def _stream(target, assistant, rows, pad, stop, capacity, prompt_width, *, max_new_tokens, block_size,
            temperature, top_k, top_p, seed, draft, exactness_probe, rounds_per_chunk):
    batch = len(rows)
    k, fallback, _ = G.effective_block_size(target, assistant, batch, block_size, temperature, pad, exactness_probe)
    gen = G.make_generate(block_size=k, max_new_tokens=G._round_up(int(max_new_tokens), G.BUDGET_BUCKET),
                          temperature=float(temperature), top_k=top_k, top_p=top_p, verify_pad=pad, draft=draft,
                          cache_size=capacity)
    prompt, lengths, key, limit, stop_ids = gen.inputs(rows, max_new_tokens=max_new_tokens, eos_token_ids=stop,
                                                       seed=seed, prompt_width=prompt_width)
    drafter = assistant if k > 1 else None
    args = (target, prompt, lengths, key, limit, stop_ids)
    try:
        pspec = gen.prefill_spec(target, prompt) if hasattr(gen, "prefill_spec") else gen.spec
        pre = _prefill_jit().lower(pspec, *args).compile()
    except (AttributeError, TypeError) as e:
        raise StreamingUnavailable(f"cannot build the prefill: {e}") from e
    t0 = time.perf_counter()
    state = jax.block_until_ready(pre(*args))
    prefill_s = time.perf_counter() - t0
    n_rounds = jnp.asarray(rounds_per_chunk, jnp.int32)
    try:
        state = _settle(gen.spec, target, drafter, state, n_rounds)
        if not bool(jax.device_get(state.done).all()):
            chunk_fn = _compiled_chunk(gen.spec, target, drafter, state, n_rounds)
    except (AttributeError, TypeError) as e:
        raise StreamingUnavailable(f"cannot build the decode chunk: {e}") from e

    out, n_out, done = jax.device_get((state.out, state.n_out, state.done))
    seen = [int(n) for n in n_out]
    pending = [out[b, :seen[b]].tolist() for b in range(batch)]
    decode_s = 0.0
    all_done = bool(done.all())
    rounds = 0
    if not all_done:
        yield StreamChunk(tokens=pending, rounds=0, done=False)
        pending = [[] for _ in range(batch)]
    while not all_done:
        t0 = time.perf_counter()
        state = chunk_fn(target, drafter, state, n_rounds)
        out, n_out, done, r = jax.device_get((state.out, state.n_out, state.done, state.rounds))
        decode_s += time.perf_counter() - t0
        rounds = int(r)
        new = [out[b, seen[b]:int(n_out[b])].tolist() for b in range(batch)]
        seen = [int(n) for n in n_out]
        all_done = bool(done.all()) or rounds >= gen.spec.max_new_tokens
        if all_done:
            pending = new
            break
        yield StreamChunk(tokens=new, rounds=rounds, done=False)
    result = G._result(state, gen.spec, batch, target, prefill_s, decode_s, fallback)
    yield StreamChunk(tokens=pending, rounds=rounds, done=True, result=result)


def generate_streaming(target, prompt_ids, *, on_tokens: Callable[[list[list[int]]], None], **kwargs) -> G.GenerationResult:
    """Run `stream_generate` to the end, calling `on_tokens(new_tokens_per_row)` for every chunk;
    returns the GenerationResult. (HF's `streamer=` style.)"""
    result = None
    for chunk in stream_generate(target, prompt_ids, **kwargs):
        if any(chunk.tokens):
            on_tokens(chunk.tokens)
        result = chunk.result
    return result
