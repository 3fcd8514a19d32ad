"""The jitted decode loops: prefill, then every round inside one `lax.while_loop` on device.

One round with block size K (classic decoding is the same machinery with K = 1 and no drafter):

1. the drafter (`LoopSpec.drafter`, `jaxspec.drafters.base`: the MTP assistant, prompt lookup, ...)
   proposes K-1 tokens, with the distributions q they were drawn from (kept) or as point masses;
2. verify `[bonus, d_0 .. d_{K-2}]` with one target forward (optionally padded, see verify.py);
3. walk: greedy (first d_i != argmax_i) or modified rejection sampling; the round emits
   d_0..d_{a-1} plus the target's token at a (a + 1 tokens), truncated to the remaining budget and
   after the first stop token;
4. roll the cache back to old + a + 1 (the last emitted token, the next bonus, is not in the cache);
   the drafter updates its own per-row state (`DecodeState.draft`) from the round.

Rows are independent: each has its own lengths, counters and done flag. A finished row keeps its
cache length, its outputs are no longer written and it counts in no statistic. `decode` (what
`generate` runs) ends when every row is done or its round budget is spent; on a GPU its exit test
is read back by the host every round, so a call returns only when its rounds are done.
`decode_rounds` (the host loops: streaming, continuous batching) runs a fixed number of rounds and
reads nothing back, so a call returns as soon as it is queued.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import models
from jaxspec.engine import penalties
from jaxspec.engine import sampling
from jaxspec.engine import verify
from jaxspec.drafters import mtp
from jaxspec.drafters.base import Round, Seed
from jaxspec.drafters.mtp import DRAFT_POSITION_OFFSET, DRAFT_UNROLL  # noqa: F401  (named here too)
from jaxspec.engine.loop_config import LoopConfig

OUT_ROUND = 16       # the output buffer holds max_new_tokens + K rounded up to this


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """Everything static about a prefill; independent of the block size, so classic and
    speculative runs of one shape share one compiled prefill."""

    sampling: sampling.SamplingMode
    max_new_tokens: int
    capacity: int
    out_width: int
    max_block: int = models.ROW_TILE  # the widest rolled-back forward (sizes the sliding rings)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Everything static about one compiled decode loop. The per-row token budget
    (<= max_new_tokens) and the stop ids are runtime inputs, so one compiled loop serves many."""

    block_size: int                 # K; 1 means classic decoding
    max_new_tokens: int             # N >= 1: output buffer size, the largest budget
    sampling: sampling.SamplingMode  # what rows may ask (the values are per-row inputs: RowParams)
    verify_pad: Any = None          # None (the target's matmul.verify_pad), a bool (True: the
                                    # qmm threshold) or an int width; see verify.verify_width
    cache_size: int | None = None   # None: prompt width + N - 1 + verify width, rounded up (LoopConfig)
    drafter: Any = None             # what proposes the drafts (jaxspec.drafters); K > 1 without one
                                    # is the MTP assistant, K = 1 has none

    def __post_init__(self):
        drafter = (self.drafter or mtp.DEFAULT) if self.block_size > 1 else None
        object.__setattr__(self, "drafter", drafter)  # classic programs are one whatever was named

    @property
    def speculative(self) -> bool:
        return self.block_size > 1

    def config(self, prompt_width: int, batch: int, matmul) -> LoopConfig:
        """This program's sizes for [batch, prompt_width] prompts (the one computation: LoopConfig)."""
        return LoopConfig.derive(self.block_size, batch, prompt_width, self.max_new_tokens, self.verify_pad,
                                 matmul, self.cache_size)

    def width(self, batch: int, matmul) -> int:
        return self.config(0, batch, matmul).verify_width

    def prefill_spec(self, prompt_width: int, batch: int, matmul) -> PrefillSpec:
        cfg = self.config(prompt_width, batch, matmul)
        return PrefillSpec(sampling=self.sampling, max_new_tokens=self.max_new_tokens, capacity=cfg.capacity,
                           out_width=self.max_new_tokens + -(-self.block_size // OUT_ROUND) * OUT_ROUND,
                           max_block=max(models.ROW_TILE, cfg.verify_width))


@struct.dataclass
class DecodeState:
    cache: Any
    bonus: jax.Array        # int32 [B]: last emitted token, not yet in the cache
    draft: Any              # the drafter's per-row state (leading axis B; None when classic); from
                            # prefill a drafters.base.Seed, which `start` gives the spec's drafter
    out: jax.Array          # int32 [B, >= N + K]: emitted tokens; row b valid up to n_out[b]
    n_out: jax.Array        # int32 [B]
    limit: jax.Array        # int32 [B]: the row's token budget (1..N)
    stop_ids: jax.Array     # int32 [S]: EOS/stop ids, padded with -1
    done: jax.Array         # bool [B]
    key: jax.Array          # one key for the batch, or one per row ([B]: jaxspec.engine.batching's slots)
    rounds: jax.Array       # int32 []: rounds in which some row was active (verify forwards that count)
    row_rounds: jax.Array   # int32 [B]: rounds in which the row was active
    drafted: jax.Array      # int32 [B]
    accepted: jax.Array     # int32 [B]: accepted draft tokens (before budget/stop truncation)
    hist: jax.Array         # int32 [K]: active row-rounds by accepted count a (empty from prefill,
                            # sized by `start`)
    finite: jax.Array       # bool [B]: the row's prefill logits were all finite (`check_prefill`)
    rows: sampling.RowParams  # each row's temperature, top_k, top_p, logit bias
    lp: Any = None          # float32 [B, W] when the mode has logprobs: out's log-probabilities
    top_ids: Any = None     # int32 [B, W, N]: the N most likely tokens at each output position
    top_lp: Any = None      # float32 [B, W, N]: their log-probabilities
    counts: Any = None      # penalties.Counts when the mode has penalties: each row's generated
                            # tokens (out[:n_out]) counted, and its prompt's tokens ([B, V] each)


# The DecodeState fields the whole batch shares. Every other field is per row (leading axis B, the
# cache's rows and the key's included), so admitting a request into a slot (`jaxspec.engine.batching`)
# writes all of them from `row_fields()`: a new per-row field cannot keep the slot's previous request's value.
SHARED_FIELDS = ("stop_ids", "rounds", "hist")


def row_fields() -> tuple[str, ...]:
    """The per-row DecodeState fields: all but SHARED_FIELDS."""
    return tuple(f.name for f in dataclasses.fields(DecodeState) if f.name not in SHARED_FIELDS)


def _cache_dtype(target):
    return verify._cache_dtype(target)


def _stop_mask(tokens, stop_ids):
    """tokens [B, T] -> bool [B, T]: is a stop id (stop_ids [S], -1 entries match nothing)."""
    if stop_ids.shape[0] == 0:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def prefill(spec: PrefillSpec, target, prompt: jax.Array, lengths: jax.Array, key: jax.Array,
            limit: jax.Array, stop_ids: jax.Array, rows: sampling.RowParams) -> DecodeState:
    """Right-padded prompts [B, P] (any pad id) with true lengths [B] (>= 1), per-row budgets
    limit [B] (1..N), stop ids [S] (pad with -1) and sampling values -> the state after the first
    token.
    The pad positions are passed as not `valid`: hidden, and not written to a sliding ring (which
    keeps each row's own newest positions); on full buffers they lie past the row's length."""
    b, p = prompt.shape
    if p > spec.capacity:
        raise ValueError(f"prompt width {p} > cache capacity {spec.capacity}")
    cache = models.init_cache(target.config, b, spec.capacity, _cache_dtype(target), max_block=spec.max_block)
    last = lengths - 1
    # valid: each row's true length, so a sliding ring keeps the row's own last positions
    valid = jnp.arange(p, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    logits, hidden, cache = models.forward(target, prompt, cache, valid=valid, logits_at=last)  # [B, 1, V]
    finite = jnp.all(jnp.isfinite(logits[:, 0]), axis=-1)  # one reduction; the host reads it once
    cache = cache.replace(lengths=lengths.astype(jnp.int32))
    key, k_first = sampling.split(key, 2)
    counts = prompt_counts(spec, prompt, lengths, logits.shape[-1])
    first = sampling.choose(k_first, logits[:, 0], rows, spec.sampling, counts)
    lps = None
    if spec.sampling.logprobs >= 0:
        lps = sampling.token_logprobs(logits, first[:, None], spec.sampling.logprobs)
    seed = draft_seed(spec, hidden[jnp.arange(b), last], prompt, lengths, first)
    return _first_state(spec, cache, first, seed, limit, stop_ids, key, finite, rows, lps, counts)


def prompt_counts(spec: PrefillSpec, prompt, lengths, vocab: int) -> penalties.Counts | None:
    """What the penalties count before the first token (the prompt's tokens), when the mode has
    penalties; else None (nothing kept)."""
    return penalties.of_prompt(prompt, lengths, vocab) if spec.sampling.penalties else None


def draft_seed(spec: PrefillSpec, h_last, prompt, lengths, first) -> Seed:
    """What the prefill leaves any drafter (`drafters.base.Seed`): the last prompt position's
    hidden, and each row's token history (prompt [B, P], then `first` at its length) in a buffer
    of the cache's capacity."""
    b, p = prompt.shape
    history = jnp.zeros((b, spec.capacity), jnp.int32).at[:, :p].set(prompt.astype(jnp.int32))
    lengths = lengths.astype(jnp.int32)
    return Seed(h_last=h_last, history=history.at[jnp.arange(b), lengths].set(first), n_prompt=lengths)


def _first_state(spec: PrefillSpec, cache, first, seed: Seed, limit, stop_ids, key, finite, rows,
                 lps=None, counts=None) -> DecodeState:
    """The state after the prompt: its first token emitted, no round run yet; `seed` what drafters
    start from (`draft_seed`). `lps`: the first token's (logprob [B, 1], top ids [B, 1, N], top
    logprobs [B, 1, N]) when the mode has logprobs. `counts`: the prompt's (`prompt_counts`) when
    the mode has penalties; the first token is counted here."""
    b = first.shape[0]
    out = jnp.zeros((b, spec.out_width), jnp.int32).at[:, 0].set(first)
    lp = top_ids = top_lp = None
    n_top = spec.sampling.logprobs
    if n_top >= 0:
        if lps is None:
            lps = (jnp.zeros((b, 1), jnp.float32), jnp.zeros((b, 1, n_top), jnp.int32),
                   jnp.zeros((b, 1, n_top), jnp.float32))
        lp = jnp.zeros((b, spec.out_width), jnp.float32).at[:, :1].set(lps[0])
        top_ids = jnp.zeros((b, spec.out_width, n_top), jnp.int32).at[:, :1].set(lps[1])
        top_lp = jnp.zeros((b, spec.out_width, n_top), jnp.float32).at[:, :1].set(lps[2])
    limit = jnp.clip(limit.astype(jnp.int32), 1, spec.max_new_tokens)
    stop_ids = stop_ids.astype(jnp.int32)
    done = _stop_mask(first[:, None], stop_ids)[:, 0] | (limit <= 1)
    if spec.sampling.penalties:
        counts = penalties.record(counts, first[:, None], jnp.ones((b, 1), bool))
    zeros = jnp.zeros((b,), jnp.int32)
    return DecodeState(cache=cache, bonus=first, draft=seed, out=out,
                       n_out=jnp.ones((b,), jnp.int32), limit=limit, stop_ids=stop_ids, done=done, key=key,
                       rounds=jnp.zeros((), jnp.int32), row_rounds=zeros, drafted=zeros,
                       accepted=zeros, hist=jnp.zeros((0,), jnp.int32), finite=finite, rows=rows, lp=lp,
                       top_ids=top_ids, top_lp=top_lp, counts=counts)


def state_shapes(spec: LoopSpec, target, prompt, limit, stop_ids, key, rows) -> DecodeState:
    """The shapes (ShapeDtypeStructs) of `start(spec, prefill(...))` for these inputs, found
    without tracing the model: decode's program can be looked up, or compiled, before the prefill
    has run."""
    b, p = prompt.shape
    return jax.eval_shape(lambda *xs: _blank(spec, target, b, p, *xs), limit, stop_ids, key, rows)


def blank_state(spec: LoopSpec, target, batch: int, prompt_width: int, stop_ids, key, rows, cache=None) -> DecodeState:
    """A decode state (decode's shapes, as `start(spec, prefill(...))` of `[batch, prompt_width]`
    prompts) whose rows are all done: empty slots for continuous batching (`jaxspec.engine.batching`).
    `cache`: the state's cache (default: `init_cache` of the spec's capacity; the engine passes a
    paged one)."""
    return _blank(spec, target, batch, prompt_width, jnp.ones((batch,), jnp.int32), stop_ids, key, rows, cache)


def _blank(spec: LoopSpec, target, b: int, p: int, limit, stop_ids, key, rows, cache=None) -> DecodeState:
    pspec = spec.prefill_spec(p, b, target.matmul)
    if cache is None:
        cache = models.init_cache(target.config, b, pspec.capacity, _cache_dtype(target), max_block=pspec.max_block)
    h_last = jnp.zeros((b, target.config.hidden_size), target.dtype)
    first = jnp.zeros((b,), jnp.int32)
    prompt, lengths = jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32)
    seed = draft_seed(pspec, h_last, prompt, lengths, first)
    counts = prompt_counts(pspec, prompt, lengths, target.config.vocab_size)
    return start(spec, _first_state(pspec, cache, first, seed, limit, stop_ids, key, jnp.ones((b,), bool), rows,
                                    counts=counts))


def decode_round(spec: LoopSpec, target, params, state: DecodeState) -> DecodeState:
    """One round; `params` the drafter's (the MTP assistant's weights; None for a drafter without)."""
    k = spec.block_size
    b = state.bonus.shape[0]
    mode = spec.sampling
    if mode.greedy:
        key = k_draft = k_accept = state.key
    else:
        key, k_draft, k_accept = sampling.split(state.key, 3)
    old_len = state.cache.lengths
    if spec.speculative:
        drafts, q, info = spec.drafter.propose(params, target, state, k, k_draft, mode)
        tokens = jnp.concatenate([state.bonus[:, None], drafts], axis=1)
    else:
        drafts, q, info = jnp.zeros((b, 0), jnp.int32), None, None
        tokens = state.bonus[:, None]
    logits, hidden, cache = verify.verify_forward(target, tokens, state.cache, spec.width(b, target.matmul))
    n_acc, emitted = sampling.accept(k_accept, drafts, q, logits, state.rows, mode, state.counts)

    active = ~state.done
    pos = jnp.arange(k, dtype=jnp.int32)[None, :]
    count = jnp.minimum(n_acc + 1, state.limit - state.n_out)
    stop = _stop_mask(emitted, state.stop_ids) & (pos < count[:, None])
    hit = jnp.any(stop, axis=1)
    count = jnp.where(hit, jnp.argmax(stop, axis=1).astype(jnp.int32) + 1, count)

    def write(buf, block):  # block [B, K, ...] into buf [B, W, ...] at each active row's n_out
        new = jax.vmap(lambda o, e, s: jax.lax.dynamic_update_slice_in_dim(o, e, s, 0))(buf, block, state.n_out)
        return jnp.where(active.reshape((b,) + (1,) * (buf.ndim - 1)), new, buf)

    out = write(state.out, emitted)
    lps = dict(lp=state.lp, top_ids=state.top_ids, top_lp=state.top_lp)  # a cheaper program leaves them
    if mode.logprobs >= 0:
        lp, top_ids, top_lp = sampling.token_logprobs(logits, emitted, mode.logprobs)
        lps = dict(lp=write(state.lp, lp), top_ids=write(state.top_ids, top_ids), top_lp=write(state.top_lp, top_lp))
    n_out = state.n_out + jnp.where(active, count, 0)
    counts = state.counts  # a cheaper program (the batch engine's, no row penalised) leaves them
    if mode.penalties:
        counts = penalties.record(counts, emitted, (pos < count[:, None]) & active[:, None])
    done = state.done | (active & (hit | (n_out >= state.limit)))
    rows = jnp.arange(b)
    # The cache keeps every emitted token but the last (the next bonus): old + count, which is
    # old + a + 1 unless the round was cut by the budget or a stop token (the row is then done).
    cache = cache.replace(lengths=jnp.where(active, old_len + count, old_len).astype(jnp.int32))
    last = jnp.maximum(count - 1, 0)  # == a unless the round was cut (the row is then done)
    bonus = jnp.where(active, emitted[rows, last], state.bonus)
    draft = state.draft
    if spec.speculative:
        draft = spec.drafter.advance(draft, info, Round(emitted=emitted, count=count, n_acc=n_acc, hidden=hidden,
                                                        last=last, n_out=state.n_out, active=active))
    act = active.astype(jnp.int32)
    return DecodeState(
        cache=cache, bonus=bonus, draft=draft, out=out, n_out=n_out, limit=state.limit,
        stop_ids=state.stop_ids, done=done, key=key,
        rounds=state.rounds + jnp.any(active).astype(jnp.int32), row_rounds=state.row_rounds + act,
        drafted=state.drafted + act * (k - 1), accepted=state.accepted + act * n_acc,
        hist=state.hist + jnp.sum(jax.nn.one_hot(n_acc, k, dtype=jnp.int32) * act[:, None], axis=0),
        finite=state.finite, rows=state.rows, counts=counts, **lps)


def check_prefill(state: DecodeState) -> None:
    """ValueError when a row's prefill logits were not all finite: a NaN/inf logit has no argmax
    or distribution (the tokens would be id 0 or garbage), and it comes from the weights. One
    small device-to-host read; `generate`, streaming and `Generator.tokens` call it."""
    finite = np.asarray(jax.device_get(state.finite))
    if not finite.all():
        rows = np.flatnonzero(~finite).tolist()
        raise ValueError(nonfinite_message(f"prompt row {rows[0]}" if len(rows) == 1 else f"prompt rows {rows}"))


def nonfinite_message(which: str) -> str:
    """What `check_prefill` (and the batching engine, per slot) says of non-finite prefill logits."""
    return (f"the target produced NaN/inf logits for the prompt ({which}): its weights are likely non-finite "
            "(a corrupt or badly converted checkpoint)")


def logprob_entries(lp, top_ids, top_lp, n_top: int | None = None) -> list[tuple]:
    """Host arrays of positions (logprob [T], top ids [T, N], top logprobs [T, N]) -> one
    (logprob, [(id, logprob), ...]) per position, the alternatives cut to the first n_top."""
    n = top_ids.shape[-1] if n_top is None else n_top
    return [(float(a), list(zip(i[:n].tolist(), b[:n].tolist()))) for a, i, b in zip(lp, top_ids, top_lp)]


def start(spec: LoopSpec, state: DecodeState) -> DecodeState:
    """The prefill's state in decode's shapes: the accepted-length histogram sized to K, and the
    drafter's own state made from the prefill's Seed (None when classic). Prefill itself depends on
    neither K nor the drafter, so classic and speculative runs of one prompt shape share it."""
    draft = spec.drafter.init(state.draft) if spec.speculative else None
    return state.replace(hist=jnp.zeros((spec.block_size,), jnp.int32), draft=draft)


def decode(spec: LoopSpec, target, params, state: DecodeState, max_rounds: jax.Array) -> DecodeState:
    """Rounds in one `lax.while_loop` while some row is active and fewer than `max_rounds` (a traced
    int32 scalar) rounds ran in this call. `generate` passes max_new_tokens, which always
    suffices (every round emits >= 1 token per active row); `Generator.decode` may pass fewer and
    call again with the returned state, one compiled program for every budget. The state's shapes
    do not change (see `start`)."""
    _check_decode(spec, params, state)

    def cond(carry):
        s, i = carry
        return jnp.any(~s.done) & (i < max_rounds)

    def body(carry):
        s, i = carry
        return decode_round(spec, target, params, s), i + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))
    return state


def decode_rounds(spec: LoopSpec, target, params, state: DecodeState, rounds: int) -> DecodeState:
    """Exactly `rounds` (static) rounds; a row that is done stays as it is (as in `decode`), but the
    loop does not stop early. Without a condition to read there is no device-to-host copy per
    round, so on a GPU the call returns as soon as its work is queued: continuous batching reads the
    last step's tokens while these rounds run (`jaxspec.engine.batching`, `jaxspec.engine.streaming`). Rounds
    run after every row is done change nothing, and `state.rounds` does not count them."""
    _check_decode(spec, params, state)
    return jax.lax.fori_loop(0, rounds, lambda _, s: decode_round(spec, target, params, s), state)


@functools.partial(jax.jit, static_argnums=1)
def snapshot(state: DecodeState, window: int) -> tuple:
    """What a host loop reads between calls: a copy (so the state itself can be donated to the next
    call while this is read) of each row's counters and its last `window` output positions before
    n_out (a host loop that reads after every call of R rounds needs window >= R * K). Returns
    (int32 [B, 6 + window]: n_out, done, row_rounds, drafted, accepted, the window's first position,
    then its tokens; and with logprobs float32 [B, window, 1 + N] (the tokens' and the top N's
    log-probabilities) and int32 [B, window, N] (the top N's ids), else None). `Snapshot.of`
    reads it."""
    window = min(window, state.out.shape[1])
    begin = jnp.maximum(state.n_out - window, 0)

    def cut(buf):
        return jax.vmap(lambda o, s: jax.lax.dynamic_slice_in_dim(o, s, window, 0))(buf, begin)

    counts = jnp.stack([state.n_out, state.done.astype(jnp.int32), state.row_rounds, state.drafted,
                        state.accepted, begin], axis=1)
    ints = jnp.concatenate([counts, cut(state.out)], axis=1)
    if state.lp is None:
        return ints, None, None
    return ints, jnp.concatenate([cut(state.lp)[..., None], cut(state.top_lp)], axis=2), cut(state.top_ids)


@dataclasses.dataclass
class Snapshot:
    """`snapshot`'s arrays on the host: per-row counters, and the output positions
    begin[b] .. begin[b] + window (`tokens(b, lo, hi)` cuts absolute positions lo..hi out of it)."""

    n_out: np.ndarray
    done: np.ndarray
    row_rounds: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    begin: np.ndarray
    out: np.ndarray
    lps: np.ndarray | None       # [B, window, 1 + N]
    top_ids: np.ndarray | None   # [B, window, N]

    @classmethod
    def of(cls, snap) -> "Snapshot":
        ints, lps, top_ids = jax.device_get(snap)
        ints = np.asarray(ints)
        n_out, done, row_rounds, drafted, accepted, begin = ints[:, :6].T
        return cls(n_out, done.astype(bool), row_rounds, drafted, accepted, begin, ints[:, 6:], lps, top_ids)

    def tokens(self, b: int, lo: int, hi: int) -> list[int]:
        s = self.begin[b]
        if lo < s:
            raise ValueError(f"positions {lo}..{hi} of row {b} are no longer in the snapshot's window")
        return self.out[b, lo - s:hi - s].tolist()

    def logprobs(self, b: int, lo: int, hi: int, n_top: int | None = None) -> list[tuple]:
        """`logprob_entries` of positions lo..hi of row b (needs logprobs)."""
        s = self.begin[b]
        lps = self.lps[b, lo - s:hi - s]
        return logprob_entries(lps[:, 0], self.top_ids[b, lo - s:hi - s], lps[:, 1:], n_top)


def _check_decode(spec: LoopSpec, params, state: DecodeState) -> None:
    if spec.speculative and spec.drafter.needs_params and params is None:
        raise ValueError(f"speculative decoding with drafter {spec.drafter.kind!r} needs an assistant")
    k = spec.block_size
    if state.out.shape[1] < spec.max_new_tokens + k - 1:
        raise ValueError(f"output buffer {state.out.shape[1]} < max_new_tokens + block_size - 1")
    if state.hist.shape != (k,):
        raise ValueError(f"hist has shape {state.hist.shape}, decode needs ({k},): pass the state through loop.start")


def run(spec: LoopSpec, target, params, prompt, lengths, key, limit, stop_ids, rows) -> DecodeState:
    """Prefill and the whole decode (one traceable function)."""
    pspec = spec.prefill_spec(prompt.shape[1], prompt.shape[0], target.matmul)
    state = start(spec, prefill(pspec, target, prompt, lengths, key, limit, stop_ids, rows))
    return decode(spec, target, params, state, jnp.int32(spec.max_new_tokens))
