"""Packed prefill: one step's prompt chunks, of any number of requests, in one compiled program.

A step's token budget (`step_tokens`) pays for every slot's decode rounds first (the decode program
computes all slots, live or not: `slots x rounds x verify width` target tokens); what is left buys
prefill lanes of `prefill_chunk` (W) tokens each (`lanes_for`), at least one lane a step so a prompt
always advances. The engine fixes its lane count P at construction.

Where a prompt is cut depends on the prompt alone: chunk i is tokens [i W, (i + 1) W), the last one
padded to W. The budget decides how many chunks run in a step, never where a prompt is cut. Every
waiting prompt gets a lane before any gets a second; lanes still free then go to the long prompts'
next chunks, oldest first (`plan`). A prompt's chunks run in lane order, each reading the KV the one
before wrote, so a long prompt takes several chunks a step where the budget has room.

The program (`run`) takes P lanes and computes them G at a time (`group`): a `[G, W]` forward per
group, over as many groups as hold a real lane (a loop with a traced bound: a step with one prompt
waiting costs one group, not P lanes). G is 1 by default on every platform: on the H200 (12B shapes,
2026-12-05) groups of 4 x 128 made a lone 64-token admission run a 512-row forward (the streams' p99
gap 13.8 -> 59.7 ms beside admissions) and a 16K prompt's first token came at 7.69 s (3.14 before),
while at 128 rows a forward already computes at the matrix units' rate. Each lane reads and writes
its own slot's rows (rings, length, table row; the shared pools through that table row); an unused
lane's table row points nowhere and its rows are never stored, so its writes are dropped. Exactness:
a dot's per-row bits depend on its row count (the CPU's XLA path; the GPU's kernels by static row
count), not on the other rows' values or a row's place among them, so a lane computes the same
whether it shares its group with nothing or with G - 1 other prompts: the group's shape `[G, W]` is
fixed per engine whatever number of lanes is real (tests/engine/test_packed_prefill.py). With G > 1
a prompt gets at most one lane a step (two of its chunks in one forward would not see each other).
A prompt's last chunk picks its first token as `loop.prefill` does (the same key split, the
penalties' prompt counts, logprobs, the drafter's seed) and writes every per-row field of its slot,
which makes the row live for the step's decode rounds.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.engine import loop, programs, sampling
from jaxspec.kernels.xla import program_options

def lanes_for(step_tokens: int, chunk: int, decode_tokens: int) -> int:
    """Prefill lanes a step may run: what the budget leaves after the decode rounds' tokens, in
    chunks, at least one (a prompt always advances)."""
    return max(1, (step_tokens - decode_tokens) // chunk)


@dataclasses.dataclass
class Prompt:
    """A prompt waiting for (more of) its prefill: its ids, how many are in the cache, and what its
    last chunk needs (key data, budget, sampling row values: host arrays of one row)."""

    ids: list[int]
    done: int
    key: np.ndarray
    limit: int
    rows: sampling.RowParams

    @property
    def rest(self) -> int:
        return len(self.ids) - self.done


def plan(prompts: dict[int, Prompt], lanes: int, chunk: int, long_first: bool, group: int = 1,
         stops: dict[int, int] | None = None) -> tuple[list[int], bool]:
    """(the slots that get a lane this step, in lane order, a slot once per chunk it advances;
    whether a long prompt waited and got none). Short prompts (the rest fits one chunk: they finish
    now) go first, then long ones, each class in admission order (`prompts`' order); after a step
    that passed the long ones over (`long_first`) the long ones go first, so the oldest advances at
    least every other step. Lanes left once every prompt has one go to the long prompts' next chunks,
    oldest first (only with `group` 1: a group's lanes run in one forward), a prompt's step ending at
    its `stops` entry (a chunk boundary ahead of it, where the engine wants the row's state) if any."""
    long = [s for s, p in prompts.items() if p.rest > chunk]
    short = [s for s in prompts if s not in long]
    chosen = (long + short if long_first else short + long)[:lanes]
    passed = bool(long) and not any(s in long for s in chosen)
    if group == 1:
        for s in long:
            p, stop = prompts[s], (stops or {}).get(s)
            left = -(-p.rest // chunk) if stop is None or stop <= p.done else (stop - p.done) // chunk
            more = min(left - 1, lanes - len(chosen)) if s in chosen else 0
            chosen += [s] * max(0, more)
    return chosen, passed


def pack(prompts: dict[int, Prompt], chosen: list[int], lanes: int, group: int, chunk: int, capacity: int,
         num_slots: int) -> dict:
    """The program's lane inputs (host arrays, one transfer): each chosen lane's chunk (a slot's
    lanes its next chunks in order, right-padded to `chunk`), its slot, real tokens, whether it is the prompt's last, and for the
    last its whole prompt (the drafter's history, the penalties' counts), key, budget and sampling.
    Unused lanes: slot `num_slots` (nowhere), one real token (a valid index), lane 0's values;
    `groups`: the groups of `group` lanes that hold a chosen one (the program skips the rest)."""
    tokens = np.zeros((lanes, chunk), np.int32)
    prompt = np.zeros((lanes, capacity), np.int32)
    slot = np.full((lanes,), num_slots, np.int32)
    n_valid, last, limit = np.ones((lanes,), np.int32), np.zeros((lanes,), bool), np.ones((lanes,), np.int32)
    keys, rows = [prompts[chosen[0]].key] * lanes, [prompts[chosen[0]].rows] * lanes
    at = {}  # slot -> where its next lane's chunk starts (a slot's lanes take its chunks in order)
    for i, s in enumerate(chosen):
        p = prompts[s]
        start = at.get(s, p.done)
        n = min(len(p.ids) - start, chunk)
        at[s] = start + n
        tokens[i, :n] = p.ids[start:start + n]
        slot[i], n_valid[i], last[i], limit[i], keys[i], rows[i] = s, n, start + n == len(p.ids), p.limit, p.key, p.rows
        if last[i]:
            prompt[i, :len(p.ids)] = p.ids
    keys, rows = np.stack(keys), jax.tree.map(lambda *r: np.concatenate(r), *rows)
    return dict(slot=slot, tokens=tokens, n_valid=n_valid, last=last, key=keys, limit=limit, rows=rows,
                prompt=prompt, groups=np.int32(-(-len(chosen) // group)))


def _take(b, idx, axis):
    return jnp.take(b, idx, axis=axis)


def _store(b, idx, rows, axis):
    """`b` with `rows` written at `idx` along `axis`; an index past the end is dropped."""
    return b.at[(slice(None),) * axis + (idx,)].set(rows.astype(b.dtype), mode="drop")


def _lane_cache(cache, slot, real):
    """The lanes' rows of a paged cache as a [G]-row cache: each lane's rings, positions, length and
    table row (an unused lane's points nowhere: its pool writes are dropped, its reads are zeros);
    the pools whole."""
    at = jnp.clip(slot, 0, cache.batch - 1)
    def bufs(xs):  # the K/V buffers are [(G,) B, L, H, D]: rows on axis ndim - 4
        return tuple(b if j in cache.paged else _take(b, at, b.ndim - 4) for j, b in enumerate(xs))
    table = jnp.where(real[:, None], _take(cache.table, at, 0), cache.num_blocks)
    return cache.replace(k=bufs(cache.k), v=bufs(cache.v), lengths=_take(cache.lengths, at, 0),
                         pos=None if cache.pos is None else _take(cache.pos, at, 0), table=table)


def _store_cache(cache, lane, idx):
    """`cache` with the lanes' rows stored at `idx` (past the end: dropped) and `lane`'s pools."""
    def bufs(big, small):
        return tuple(o if j in cache.paged else _store(b, idx, o, b.ndim - 4)
                     for j, (b, o) in enumerate(zip(big, small)))
    return cache.replace(k=bufs(cache.k, lane.k), v=bufs(cache.v, lane.v),
                         lengths=_store(cache.lengths, idx, lane.lengths, 0),
                         pos=None if cache.pos is None else _store(cache.pos, idx, lane.pos, 0),
                         table=_store(cache.table, idx, lane.table, 0))


def _group(state: loop.DecodeState, target, g, lanes: dict, *, spec: loop.PrefillSpec, loop_spec: loop.LoopSpec,
           group: int) -> loop.DecodeState:
    """Lanes [g G, (g + 1) G) of `lanes` into their slots (see the module docstring)."""
    part = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, g * group, group, 0), lanes)
    slot, tokens, n_valid, last = part["slot"], part["tokens"], part["n_valid"], part["last"]
    row = _lane_cache(state.cache, slot, slot < state.cache.batch)
    w = tokens.shape[1]
    valid = jnp.arange(w, dtype=jnp.int32)[None, :] < n_valid[:, None]
    logits, hidden, row = models.forward(target, tokens, row, valid=valid, logits_at=n_valid - 1)
    row = row.replace(lengths=(row.lengths - w + n_valid).astype(jnp.int32))
    # Every lane picks a first token; only a prompt's last chunk keeps it (and all its row's fields).
    finite = jnp.all(jnp.isfinite(logits[:, 0]), axis=-1)
    key = jax.random.wrap_key_data(part["key"])
    key, k_first = sampling.split(key, 2)
    counts = loop.prompt_counts(spec, part["prompt"], row.lengths, logits.shape[-1])
    first = sampling.choose(k_first, logits[:, 0], part["rows"], spec.sampling, counts)
    lps = None
    if spec.sampling.logprobs >= 0:
        lps = sampling.token_logprobs(logits, first[:, None], spec.sampling.logprobs)
    h_last = jnp.take_along_axis(hidden, (n_valid - 1)[:, None, None], axis=1)[:, 0]
    seed = loop.draft_seed(spec, h_last, part["prompt"], row.lengths, first)
    one = loop._first_state(spec, row, first, seed, part["limit"], state.stop_ids, key, finite, part["rows"], lps,
                            counts)
    return put_lanes(state, loop.start(loop_spec, one), slot, last)


def _set(big, idx, small):
    return big.at[idx].set(small if small.dtype == big.dtype else small.astype(big.dtype), mode="drop")


def put_lanes(state: loop.DecodeState, one: loop.DecodeState, slot, last) -> loop.DecodeState:
    """`state` with the lanes of `one` (a [G]-row state; its cache `_lane_cache`'s, after the forward)
    stored into their slots: every lane with a slot (`slot` < the state's rows) stores its cache rows;
    a prompt's last chunk (`last`) stores every per-row field (`loop.row_fields`: its tokens, budget,
    counters, key, sampling values, log-probabilities, drafter state, and any field added later), so
    nothing of the slot's previous request survives. The shared fields stay the state's; the pools
    are `one`'s, whole (the lanes wrote into them through their table rows)."""
    b = state.cache.batch
    real = slot < b
    cache = _store_cache(state.cache, one.cache, jnp.where(real, slot, b))
    done = jnp.where(real & last, slot, b)
    new = {f: jax.tree.map(lambda big, small: _set(big, done, small), getattr(state, f), getattr(one, f))
           for f in loop.row_fields() if f != "cache"}
    return state.replace(cache=cache, **new)


def run(*args, **kw):
    """`_run`, jitted with jaxspec's program options (kernels.xla.program_options: known only once
    the backend is, so the jit is made on first use)."""
    return _run_jit()(*args, **kw)


def compiled(state: loop.DecodeState, target, lanes: dict, *, spec: loop.PrefillSpec, loop_spec: loop.LoopSpec,
             group: int):
    """`(state, target, lanes) -> run(...)`'s result: `run`'s program for these shapes (an engine's
    lanes have one shape), from memory, else whole from disk (`jaxspec.engine.programs`), else
    compiled. Through `run`'s jit a new process traced and lowered it again before JAX's cache could
    find it: ~2 s of a warm `jaxspec serve` start on a quiet 2-core CPU. The state is donated."""
    args = (state, target, lanes)
    return programs.compiled(programs.Program(
        "packed_prefill", (spec, loop_spec, group), args,
        lambda: _run_jit().lower(*args, spec=spec, loop_spec=loop_spec, group=group)))


@functools.cache
def _run_jit():
    return jax.jit(_run, static_argnames=("spec", "loop_spec", "group"), donate_argnums=(0,),
                   compiler_options=program_options() or None)


def _run(state: loop.DecodeState, target, lanes: dict, *, spec: loop.PrefillSpec, loop_spec: loop.LoopSpec,
        group: int):
    """One step's chunks (`pack`'s lanes, `lanes["groups"]` groups of `group` hold a real one) into
    their slots -> (the state, what the host reads of each lane's slot after it: first token, done,
    finite, the token's logprobs)."""
    per_lane = {k: v for k, v in lanes.items() if k != "groups"}

    def body(g, st):
        return _group(st, target, g, per_lane, spec=spec, loop_spec=loop_spec, group=group)
    state = jax.lax.fori_loop(0, lanes["groups"], body, state)
    at = jnp.clip(lanes["slot"], 0, state.cache.batch - 1)
    lps = None if state.lp is None else (state.lp[at, 0], state.top_ids[at, 0], state.top_lp[at, 0])
    return state, (state.bonus[at], state.done[at], state.finite[at], lps)
