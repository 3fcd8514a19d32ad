"""Training-time test (TTT) for the MTP drafter: the drafter unrolled on its OWN drafts, as the loop
runs it, with a token-level KL to the target's distribution at every drafted position.

For every query position t of a row (cache = the row's tokens 0..t, bonus = token t+1, h = the
target's hidden at t), `jaxspec.drafters.mtp.draft_chain` (the function the speculative loop calls)
drafts `steps` tokens, each fed its own previous draft and h_next. Draft j guesses token t+2+j; its
loss is KL(p || q): p the target's distribution there (its top-k log-probabilities, stored by
`jaxspec.train.onpolicy_data`, renormalised over the tokens the draft head can emit), q the head's
softmax; optionally plus cross-entropy on the row's own token (the target's greedy or sampled one).
The target's distribution is conditioned on the row's text: after a wrong draft the loop stops
counting, so later positions are trained as if the earlier drafts were right, which they were
whenever the loop reaches them at temperature 0.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import models
from jaxspec.drafters.mtp import DRAFT_POSITION_OFFSET, draft_chain
from jaxspec.train import shared
from jaxspec.train.shared import TRAIN_MATMUL


def head_index(vocab_size: int, draft_vocab=None) -> np.ndarray:
    """int32 [V]: each token's index in the draft head's output (-1: the head cannot emit it)."""
    if draft_vocab is None:
        return np.arange(vocab_size, dtype=np.int32)
    out = np.full(vocab_size, -1, np.int32)
    out[np.asarray(draft_vocab)] = np.arange(len(draft_vocab), dtype=np.int32)
    return out


def kl_topk(teacher_ids, teacher_lp, student_logits, index_of):
    """KL(p || q) per position -> (kl [...], weight [...]).

    teacher_ids int [..., k], teacher_lp [..., k]: the target's k most likely tokens and their
    log-probabilities; student_logits [..., N] the draft head's; index_of int32 [V] (`head_index`).
    p: the teacher's entries the head can emit, renormalised; q: softmax of the student logits.
    weight is 0 (and kl 0) where none of the k can be emitted."""
    idx = index_of[teacher_ids]
    inside = idx >= 0
    lp = jnp.where(inside, teacher_lp.astype(jnp.float32), -jnp.inf)
    logz = jax.nn.logsumexp(lp, axis=-1, keepdims=True)
    ok = jnp.isfinite(logz[..., 0])
    logp = jnp.where(inside, lp - jnp.where(ok[..., None], logz, 0.0), 0.0)
    p = jnp.where(inside, jnp.exp(logp), 0.0)
    logq_all = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    logq = jnp.take_along_axis(logq_all, jnp.maximum(idx, 0), axis=-1)
    kl = jnp.sum(jnp.where(inside, p * (logp - logq), 0.0), axis=-1)
    return jnp.where(ok, kl, 0.0), ok.astype(jnp.float32)


def ttt_queries(prompt_len: int, seq: int, steps: int) -> tuple[int, int]:
    """[t0, t1): the query positions whose `steps` drafted positions all lie in the continuation."""
    t0, t1 = prompt_len - 2, seq - steps - 1
    if t0 < 0 or t1 <= t0:
        raise ValueError(f"rows of {seq} tokens with {prompt_len}-token prompts leave no query for {steps} draft steps")
    return t0, t1


def unrolled(assistant, teacher, rows, hidden, cache, t0: int, t1: int, steps: int):
    """draft_chain over the queries t0..t1-1 of every row -> (drafts [B, Q, steps], [steps] logits [B, Q, N])."""
    b = rows.shape[0]
    lengths = jnp.broadcast_to(jnp.arange(t0 + 1, t1 + 1, dtype=jnp.int32)[None], (b, t1 - t0))
    kv = models.shared_kv(teacher.config, cache)
    return draft_chain(assistant, teacher, kv, rows[:, t0 + 1:t1 + 1], hidden[:, t0:t1], lengths,
                       lengths + DRAFT_POSITION_OFFSET, steps)


def make_loss(acfg, tcfg, prompt_len: int, seq: int, steps: int, dtype, ce_weight: float, index_of):
    """loss(trainable, frozen, teacher_params, rows [B, S], top_ids [B, S - P, k], top_lp) ->
    (loss, aux [3 * steps]): per draft step the share of drafts equal to the target's argmax, the
    weighted KL and the share of positions whose top-1 the head can emit. `frozen` holds the
    drafter's untrained params (the shared table, the trimmed head's ids and rows)."""
    t0, t1 = ttt_queries(prompt_len, seq, steps)
    q = t1 - t0
    index_of = jnp.asarray(index_of)

    def loss(p, frozen, tp, rows, top_ids, top_lp):
        teacher = models.Target(config=tcfg, params=tp, matmul=TRAIN_MATMUL)
        cache = models.init_cache(tcfg, rows.shape[0], seq, dtype, ring=False)
        _, hidden, cache = models.forward(teacher, rows, cache)  # the logits are dead code
        hidden, cache = jax.lax.stop_gradient((hidden, cache))
        assistant = models.Assistant(config=acfg, params=dict(shared.to_dtype(p, dtype), **frozen), matmul=TRAIN_MATMUL)
        drafts, logits = unrolled(assistant, teacher, rows, hidden, cache, t0, t1, steps)
        total, aux = 0.0, []
        for j in range(steps):
            # draft j at query t guesses position t+2+j: the continuation's index t+2+j-P
            ids, lp = top_ids[:, j:j + q], top_lp[:, j:j + q]
            kl, w = kl_topk(ids, lp, logits[j], index_of)
            term = jnp.sum(kl) / jnp.maximum(jnp.sum(w), 1.0)
            if ce_weight:
                lab = rows[:, t0 + 2 + j:t1 + 2 + j]
                li = index_of[lab]
                lq = jax.nn.log_softmax(logits[j], axis=-1)
                nll = -jnp.take_along_axis(lq, jnp.maximum(li, 0)[..., None], axis=-1)[..., 0]
                m = (li >= 0).astype(jnp.float32)
                term = term + ce_weight * jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)
            total = total + term
            aux += [jnp.mean((drafts[..., j] == ids[..., 0]).astype(jnp.float32)), term,
                    jnp.mean((index_of[ids[..., 0]] >= 0).astype(jnp.float32))]
        return total / steps, jnp.stack(aux)

    return loss
