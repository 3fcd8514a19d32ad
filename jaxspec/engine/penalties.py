"""Repetition controls: presence / frequency penalties (OpenAI) and the repetition penalty (HF), per row.

For token t of a row, with c[t] the times t was generated so far and s[t] whether t is in the prompt:

    repetition (HF's RepetitionPenaltyLogitsProcessor, over prompt + generated tokens):
        x[t] -> x[t] * r if x[t] < 0 else x[t] / r          where s[t] or c[t] > 0
    presence and frequency (OpenAI's formula, over the generated tokens only):
        x[t] -> x[t] - c[t] * frequency - (c[t] > 0) * presence

applied in that order, to the logits after the logit bias and before temperature and filtering
(vLLM's order). A row with presence = frequency = 0 and r = 1 keeps its logits bit for bit (x * 1,
x / 1, x - 0 are exact), so rows with and without penalties share a program.

The state is `Counts`: per row, int32 counts of the generated tokens and a bool mask of the prompt's,
[B, V] each; the loop keeps it only in programs whose `SamplingMode` has `penalties`.

In a speculative round the verify scores [bonus, d_0 .. d_{K-2}]: its position j predicts the token
after d_{j-1}, so its counts are the round's counts plus d_0 .. d_{j-1} (what classic decoding would
have counted by then: this is what keeps speculation exact). Those differ from the round's counts only
at the drafted tokens, so `apply` penalises every position with the round's counts ([B, K, V], no
[B, K, V] counts built) and then rewrites the K * (K-1) entries at the drafted tokens with their own
counts (a gather and a scatter of [B, K, K-1]); entries of one token at one position get one value,
whichever draft wrote it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Counts:
    """What the penalties count, per row: generated int32 [B, V] (each generated token's count so
    far, the bonus included) and prompt bool [B, V] (the prompt's tokens)."""

    generated: jax.Array
    prompt: jax.Array


def of_prompt(prompt: jax.Array, lengths: jax.Array, vocab: int) -> Counts:
    """Counts before the first token: prompt int32 [B, P] (right-padded; row b valid up to
    lengths[b]), nothing generated."""
    b, p = prompt.shape
    valid = jnp.arange(p, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    rows = jnp.arange(b)[:, None]
    mask = jnp.zeros((b, vocab), jnp.int32).at[rows, prompt.astype(jnp.int32)].max(valid.astype(jnp.int32))
    return Counts(generated=jnp.zeros((b, vocab), jnp.int32), prompt=mask > 0)


def record(counts: Counts, tokens: jax.Array, take: jax.Array) -> Counts:
    """`counts` with tokens int32 [B, T] added where take (bool [B, T]) holds."""
    rows = jnp.arange(tokens.shape[0])[:, None]
    return counts.replace(generated=counts.generated.at[rows, tokens].add(take.astype(jnp.int32)))


def _penalised(x, c, s, presence, frequency, repetition, inverse):
    """The definition, elementwise: logits x (float32), counts c (int32), prompt mask s; the
    per-row values broadcast against them. Both of `apply`'s paths compute exactly this. x / r is
    x * (1 / r), one reciprocal per row: XLA rewrites a division by a broadcast so anyway, and
    spelled out it cannot differ between programs (classic and speculative must agree bit for bit);
    it is within an ulp of x / r."""
    rep = jnp.where(x < 0, x * repetition, x * inverse)
    x = jnp.where(s | (c > 0), rep, x)
    return x - c.astype(jnp.float32) * frequency - jnp.where(c > 0, presence, 0.0)


def apply(logits: jax.Array, counts: Counts, presence: jax.Array, frequency: jax.Array, repetition: jax.Array,
          drafts: jax.Array | None = None) -> jax.Array:
    """The penalised logits (float32) of logits [B, V] (one position per row, `counts` its own) or
    [B, K, V] (a verify block: position j also counts drafts[:, :j], drafts int32 [B, K-1]).
    presence, frequency, repetition: float32 [B]."""
    x = logits.astype(jnp.float32)
    b, nd = x.shape[0], x.ndim
    per_row = lambda v: v.reshape((b,) + (1,) * (nd - 1))  # noqa: E731
    pen = (per_row(presence), per_row(frequency), per_row(repetition), per_row(1.0 / repetition))
    c, s = counts.generated, counts.prompt
    if nd == 3:
        c, s = c[:, None], s[:, None]
    out = _penalised(x, c, s, *pen)
    if nd == 2 or drafts is None or drafts.shape[1] == 0:
        return out
    k, m = x.shape[1], drafts.shape[1]
    # more[b, j, i]: how often d_i occurs among d_0 .. d_{j-1}
    same = drafts[:, :, None] == drafts[:, None, :]                        # [B, i', i]
    before = jnp.arange(m)[None, :] < jnp.arange(k)[:, None]               # [j, i']: i' < j
    more = jnp.sum(before[None, :, :, None] & same[:, None, :, :], axis=2, dtype=jnp.int32)  # [B, K, M]
    at = jnp.broadcast_to(drafts[:, None, :], (b, k, m))
    c_d = jnp.take_along_axis(counts.generated, drafts, axis=1)[:, None, :] + more
    s_d = jnp.take_along_axis(counts.prompt, drafts, axis=1)[:, None, :]
    vals = _penalised(jnp.take_along_axis(x, at, axis=2), c_d, s_d, *pen)
    return out.at[jnp.arange(b)[:, None, None], jnp.arange(k)[None, :, None], at].set(vals)
