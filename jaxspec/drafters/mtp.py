"""The MTP assistant as a drafter: a small model that reads the target's KV cache and its last hidden
state and drafts K-1 tokens one step at a time (`models.draft_step`).

Its params are the assistant's weights (`models.Assistant`); its per-row state is `h_prev [B, H]`, the
target's post-norm hidden at the bonus token's predecessor (the prefill's last prompt position, then
the verify hidden at the last emitted token).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec import models
from jaxspec.engine import penalties, sampling
from jaxspec.drafters.base import Round, Seed

# Query position passed to models.draft_step, relative to the cache length L at the start of a
# round (after rollback; the bonus token's position is L). 0 is HF's convention, the one
# models.draft_step documents (mlx-vlm would be -1). Held constant over the round's draft steps.
DRAFT_POSITION_OFFSET = 0

# Unroll the K-1 draft steps: on GPU a nested while loop costs a predicate copy to the host per
# iteration; unrolled, a round has exactly one loop (the rounds themselves).
DRAFT_UNROLL = True


@dataclasses.dataclass(frozen=True)
class Drafter:
    kind: ClassVar[str] = "mtp"
    needs_params: ClassVar[bool] = True

    def describe(self) -> str:
        return "mtp (the MTP assistant)"

    def init(self, seed: Seed):
        return seed.h_last

    def propose(self, assistant, target, state, k: int, key, mode: sampling.SamplingMode):
        """K-1 drafts [B, K-1] and their distributions q [B, K-1, V] (None when greedy): argmax at
        T = 0, a sample from the filtered q at T > 0."""
        position = state.cache.lengths + DRAFT_POSITION_OFFSET
        cache = state.cache
        if mode.greedy and not mode.bias and not mode.penalties and assistant.tp is None:
            # plain argmax drafts: the chain training unrolls (draft_chain), over the head's own
            # vocabulary (a trimmed head never builds the [B, V] logits)
            kv = models.shared_kv(target.config, cache)
            drafts, _ = draft_chain(assistant, target, kv, state.bonus[:, None], state.draft[:, None],
                                    cache.lengths.astype(jnp.int32)[:, None], position.astype(jnp.int32)[:, None],
                                    k - 1)
            return drafts[:, 0], None, None
        # With penalties the drafts are penalised as the verify will be (the counts so far plus the
        # drafts before): not needed for exactness, but the drafts then follow the penalised target.
        counts = state.counts if mode.penalties else None

        def step(carry, step_key):
            tok, h, counts = carry
            logits, h_next = models.draft_step(assistant, target, cache, tok, h, position)
            d, q = sampling.draft_choice(step_key, logits, state.rows, mode, counts)
            if counts is not None:
                counts = penalties.record(counts, d[:, None], jnp.ones((d.shape[0], 1), bool))
            return (d, h_next.astype(h.dtype), counts), (d if q is None else (d, q))

        keys = None if mode.greedy else sampling.split(key, k - 1)  # greedy: no RNG work at all
        _, ys = jax.lax.scan(step, (state.bonus, state.draft, counts), keys, length=k - 1, unroll=DRAFT_UNROLL)
        if mode.greedy:
            return jnp.swapaxes(ys, 0, 1), None, None
        d, q = ys
        return jnp.swapaxes(d, 0, 1), jnp.swapaxes(q, 0, 1), None

    def advance(self, h_prev, info, rnd: Round):
        rows = jnp.arange(h_prev.shape[0])
        return jnp.where(rnd.active[:, None], rnd.hidden[rows, rnd.last].astype(h_prev.dtype), h_prev)

    def counters(self, h_prev) -> dict[str, int]:
        return {}


def draft_chain(assistant, target, kv: dict, token, h_prev, lengths, position, steps: int):
    """The loop's greedy drafting, for `Q` queries per row at once: `steps` draft steps
    (`models.draft_logits`), each drafting the argmax of the head (mapped to token ids: `draft_ids`)
    and feeding it, with its h_next, to the next. token [B, Q], h_prev [B, Q, H_target], kv
    `models.shared_kv` of the target's cache, lengths / position [B, Q] as `models.assistant_stack`
    takes them. Returns (drafts int32 [B, Q, steps], [steps] head logits float32 [B, Q, N]).

    `Drafter.propose` runs it at Q = 1 on the loop's state; training-time test
    (`jaxspec.train.ttt`) runs it over every position of a row, so the drafter is trained on its own
    drafts exactly as the loop makes them (unrolled, as DRAFT_UNROLL unrolls the loop's steps)."""
    drafts, logits = [], []
    for _ in range(steps):
        lg, h_next = models.draft_logits(assistant, target, kv, token, h_prev, lengths, position)
        token = models.draft_ids(assistant, jnp.argmax(lg, axis=-1))
        drafts.append(token)
        logits.append(lg)
        h_prev = h_next.astype(h_prev.dtype)  # the loop carries h_next in the target hidden's dtype
    return jnp.stack(drafts, axis=-1), logits


DEFAULT = Drafter()
