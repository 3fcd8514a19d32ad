"""Prompt lookup (n-gram) drafting inside the jitted loop: no model, no host round trip.

Each row keeps its token history on the device (`history [B, C]`: the prompt, then every emitted
token; C is the cache capacity, which bounds them). A round looks for the most recent earlier
occurrence of the row's last n tokens, for n from n_max down to n_min (the first n that matches
wins), and proposes the K-1 tokens that followed it. When the match is so recent that fewer than K-1
tokens follow it (a loop in the text), the continuation repeats with the match's period: the tokens
after the history's end would be the drafts themselves. No match: the drafts repeat the last token
(a round that verifies what it has; shapes never change, so nothing recompiles per prompt).

The drafts are point masses (q = one_hot(d)), so sampling stays lossless with the rule for them:
accept d with probability p(d), on rejection sample from p with d removed (`sampling.accept` with
q None). Greedy output is classic decoding's whatever is drafted.

Cost per round: (n_min + ... + n_max) compares of [B, C] int32 and one gather; no matmul.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.drafters.base import Round, Seed

# Defaults (see docs/loop.md, "Drafters"): n from 3 down to 1. A longer n_max finds fewer but surer
# matches; n = 1 still drafts in text with no longer repeat, and a wrong draft costs nothing but
# the verify rows it occupies.
N_MIN, N_MAX = 1, 3
N_LIMIT = 16  # n_max at most: each n is n compares of the whole history per round


@struct.dataclass
class State:
    """Per row: history int32 [B, C] (prompt, then emitted tokens; valid up to n_prompt + n_out),
    n_prompt int32 [B], and counters: rounds with a match (`matched`), accepted drafts of rounds
    whose match continued in the prompt (`from_prompt`) or in the row's own output (`from_output`)."""

    history: jax.Array
    n_prompt: jax.Array
    matched: jax.Array
    from_prompt: jax.Array
    from_output: jax.Array


@dataclasses.dataclass(frozen=True)
class Drafter:
    kind: ClassVar[str] = "ngram"
    needs_params: ClassVar[bool] = False
    n_min: int = N_MIN
    n_max: int = N_MAX

    def __post_init__(self):
        for name in ("n_min", "n_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= N_LIMIT:
                raise ValueError(f"ngram {name} must be an integer in 1..{N_LIMIT}, got {v!r}")
        if self.n_min > self.n_max:
            raise ValueError(f"ngram n_min={self.n_min} is larger than n_max={self.n_max}")

    def describe(self) -> str:
        return f"ngram (prompt lookup, n={self.n_max}..{self.n_min})"

    def init(self, seed: Seed) -> State:
        zeros = lambda: jnp.zeros_like(seed.n_prompt)  # noqa: E731  (one buffer each: decode donates the state)
        return State(history=seed.history, n_prompt=seed.n_prompt, matched=zeros(), from_prompt=zeros(),
                     from_output=zeros())

    def propose(self, params, target, state, k: int, key, mode):
        s = state.draft
        drafts, n, start = lookup(s.history, s.n_prompt + state.n_out, k - 1, self.n_min, self.n_max)
        return drafts, None, (n > 0, start < s.n_prompt)

    def advance(self, s: State, info, rnd: Round) -> State:
        found, in_prompt = info
        at = s.n_prompt + rnd.n_out  # where this round's first token goes (the bonus is at at - 1)
        new = jax.vmap(lambda h, e, i: jax.lax.dynamic_update_slice_in_dim(h, e, i, 0))(s.history, rnd.emitted, at)
        act = rnd.active
        used = jnp.where(act & found, rnd.n_acc, 0)
        return s.replace(history=jnp.where(act[:, None], new, s.history),
                         matched=s.matched + (act & found).astype(jnp.int32),
                         from_prompt=s.from_prompt + jnp.where(in_prompt, used, 0),
                         from_output=s.from_output + jnp.where(in_prompt, 0, used))

    def counters(self, s: State) -> dict[str, int]:
        return {"matched_rounds": int(np.sum(s.matched)), "accepted_from_prompt": int(np.sum(s.from_prompt)),
                "accepted_from_output": int(np.sum(s.from_output))}


DEFAULT = Drafter()


def lookup(history: jax.Array, length: jax.Array, m: int, n_min: int, n_max: int):
    """history int32 [B, C] valid up to length [B] (>= 1; its last token is the newest) -> (drafts
    int32 [B, m], n [B]: the n-gram length that matched (0: none), start [B]: where the matched
    continuation begins in the history (0 when none)).

    For n = n_max .. n_min the row's last n tokens are compared with every earlier window; the
    latest window that ends before the last token (so at least one token follows it) matches; the
    first n with a match wins. drafts[i] = history[start + i mod (length - start)]: the tokens that
    followed, repeated with the match's period when fewer than m follow. No match: the last token."""
    b, c = history.shape
    length = length.astype(jnp.int32)
    best_n = jnp.zeros((b,), jnp.int32)
    best_start = jnp.zeros((b,), jnp.int32)
    for n in range(min(n_max, c - 1), n_min - 1, -1):
        w = c - n  # windows j = 0 .. c-n-1 whose next token h[j + n] lies in the buffer
        suffix = jnp.take_along_axis(history, jnp.clip(length[:, None] - n + jnp.arange(n), 0, c - 1), axis=1)
        match = jnp.ones((b, w), bool)
        for i in range(n):
            match &= history[:, i:i + w] == suffix[:, i:i + 1]
        j = jnp.arange(w, dtype=jnp.int32)[None, :]
        match &= j + n < length[:, None]  # the window ends before the last token: a continuation exists
        latest = jnp.max(jnp.where(match, j, -1), axis=1)
        take = (latest >= 0) & (best_n == 0)
        best_n = jnp.where(take, n, best_n)
        best_start = jnp.where(take, latest + n, best_start)
    period = jnp.maximum(length - best_start, 1)
    src = best_start[:, None] + jnp.arange(m, dtype=jnp.int32)[None, :] % period[:, None]
    drafts = jnp.take_along_axis(history, src, axis=1)
    newest = jnp.take_along_axis(history, jnp.maximum(length - 1, 0)[:, None], axis=1)
    return jnp.where(best_n[:, None] > 0, drafts, newest).astype(jnp.int32), best_n, best_start
