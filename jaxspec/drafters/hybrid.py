"""Prompt lookup first, the MTP assistant otherwise: each row takes the n-gram draft when its last
n tokens (n from n_max down to n_min) occur earlier in its prompt or output, the assistant's draft
when they do not (`jaxspec.drafters.ngram`, `jaxspec.drafters.mtp`).

Why: prompt lookup is nearly free and wins where the text copies its prompt (code edits, extraction:
2.5x on the real Gemma 3 270M), the assistant wins on text that copies nothing. A round whose every
row found a match (or is done: a finished row or an empty slot drafts nothing that counts) skips the
assistant's draft steps (one `lax.cond`: at B = 1, every matched round), so a matched round costs what
an n-gram round costs. On a GPU a conditional reads its predicate back
once a round (as a nested loop would: `mtp.DRAFT_UNROLL`); not measured there yet.

n_min defaults to 2: a 1-token match proposes whatever followed the last occurrence of one token,
and on text that copies nothing the assistant drafts better (on Gemma 3 270M, prompt lookup's first
drafts, n = 3..1, were accepted 0.25 of the time on open prose, the 12-04 assistant's 0.46 on 24
held-out prompts: docs/benchmark_results/ngram-cpu-2026-12-04.md, drafter-h200-2026-12-04.md). On the default pair's
three task sets n_min = 1 / 2 / 3 gave 2.10x / 2.11x / 2.04x on average, each set above both drafters
alone (docs/benchmark_results/hybrid-cpu-2026-12-05.md).

Exactness: the loop's verify and walk are the same whichever drafter a row used. Sampled rows keep
the target's distribution: an n-gram row's draft is a point mass, given to the accept step as
q = one_hot(d), whose rule (accept with p(d), else sample p without d) is the point-mass rule (as
`draft="argmax"` does); an assistant row keeps its q.

Per-row state: the assistant's h_prev and the n-gram history; counters: the n-gram's (its matched
rounds are the rounds it drafted), `assisted_rounds` (the rows' rounds the assistant drafted) and
`assistant_skipped_rounds` (the rows' rounds in which the assistant did not run at all: the branch
taken, counted by the branch itself).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.drafters import mtp, ngram
from jaxspec.drafters.base import Round, Seed

N_MIN = 2


@struct.dataclass
class State:
    h_prev: jax.Array       # [B, H]: the MTP drafter's state
    lookup: ngram.State     # the n-gram drafter's state (history, counters)
    assisted: jax.Array     # int32 [B]: rounds the assistant drafted, per row
    skipped: jax.Array      # int32 [B]: rounds in which the assistant did not run, per row


@dataclasses.dataclass(frozen=True)
class Drafter:
    kind: ClassVar[str] = "hybrid"
    needs_params: ClassVar[bool] = True
    n_min: int = N_MIN
    n_max: int = ngram.N_MAX

    def __post_init__(self):
        try:  # the n-gram drafter's bounds
            ngram.Drafter(n_min=self.n_min, n_max=self.n_max)
        except ValueError as e:
            raise ValueError(str(e).replace("ngram", "hybrid", 1)) from None

    @property
    def _lookup(self) -> ngram.Drafter:
        return ngram.Drafter(n_min=self.n_min, n_max=self.n_max)

    def describe(self) -> str:
        return f"hybrid (prompt lookup n={self.n_max}..{self.n_min}, else the MTP assistant)"

    def init(self, seed: Seed) -> State:
        zeros = lambda: jnp.zeros_like(seed.n_prompt)  # noqa: E731  (one buffer each: decode donates the state)
        return State(h_prev=mtp.DEFAULT.init(seed), lookup=self._lookup.init(seed), assisted=zeros(),
                     skipped=zeros())

    def propose(self, assistant, target, state, k: int, key, mode):
        s = state.draft
        d_n, n, start = ngram.lookup(s.lookup.history, s.lookup.n_prompt + state.n_out, k - 1, self.n_min,
                                     self.n_max)
        found = n > 0
        inner = state.replace(draft=s.h_prev)

        def assist():
            d, q, _ = mtp.DEFAULT.propose(assistant, target, inner, k, key, mode)
            return d, q, jnp.int32(0)

        shapes = jax.eval_shape(assist)

        def lookup_only():  # what assist() would return, unused: every row found a match or is done
            d, q, _ = (None if x is None else jnp.zeros(x.shape, x.dtype) for x in shapes)
            return d, q, jnp.int32(1)

        # a done row (finished, or an empty slot) drafts nothing that counts: it takes the lookup's draft
        # (its last token) and q, and does not hold the skip back
        take = found | state.done
        d_a, q_a, skipped = jax.lax.cond(jnp.all(take), lookup_only, assist)
        drafts = jnp.where(take[:, None], d_n, d_a)
        q = None if q_a is None else jnp.where(take[:, None, None], jax.nn.one_hot(d_n, q_a.shape[-1], dtype=q_a.dtype),
                                               q_a)
        return drafts, q, (found, start < s.lookup.n_prompt, skipped)

    def advance(self, s: State, info, rnd: Round) -> State:
        found, in_prompt, skipped = info
        act = rnd.active.astype(jnp.int32)
        return State(h_prev=mtp.DEFAULT.advance(s.h_prev, None, rnd),
                     lookup=self._lookup.advance(s.lookup, (found, in_prompt), rnd),
                     assisted=s.assisted + act * (~found).astype(jnp.int32), skipped=s.skipped + act * skipped)

    def counters(self, s: State) -> dict[str, int]:
        return dict(self._lookup.counters(s.lookup), assisted_rounds=int(np.sum(s.assisted)),
                    assistant_skipped_rounds=int(np.sum(s.skipped)))


DEFAULT = Drafter()
