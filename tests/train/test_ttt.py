"""Training-time test (jaxspec.train.ttt_loss, jaxspec.train.ttt): the KL against a float64 numpy
reference, the training unroll against the loop's own drafting (Drafter.propose on the same state),
and end to end on a tiny target: on-policy data, training, the trained drafter beating the
untrained one in the loop with output identical to classic decoding."""
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from jaxspec.drafters import mtp
from jaxspec.engine import sampling
from jaxspec.models import presets
from jaxspec.train import ttt_loss
from support.seeds import seeded_int, seeded_rng


def _kl_reference(ids, lp, logits, index_of):
    """float64, one position at a time."""
    kl, w = np.zeros(ids.shape[:-1]), np.zeros(ids.shape[:-1])
    lq_all = logits - logits.max(-1, keepdims=True)
    lq_all = lq_all - np.log(np.exp(lq_all).sum(-1, keepdims=True))
    for pos in np.ndindex(*ids.shape[:-1]):
        keep = [(index_of[t], v) for t, v in zip(ids[pos], lp[pos]) if index_of[t] >= 0]
        if not keep:
            continue
        idx = np.asarray([i for i, _ in keep])
        v = np.asarray([x for _, x in keep], np.float64)
        logp = v - np.log(np.exp(v - v.max()).sum()) - v.max()
        kl[pos] = np.sum(np.exp(logp) * (logp - lq_all[pos][idx]))
        w[pos] = 1.0
    return kl, w


def test_kl_topk_matches_float64_reference():
    rng = seeded_rng()
    v, n, k = 300, 120, 8
    vocab = rng.permutation(v)[:n]
    index_of = ttt_loss.head_index(v, vocab)
    assert (index_of[vocab] == np.arange(n)).all() and (index_of >= 0).sum() == n
    ids = np.stack([rng.permutation(v)[:k] for _ in range(2 * 5)]).reshape(2, 5, k)
    ids[0, 0] = np.setdiff1d(np.arange(v), vocab)[:k]  # no teacher token in the head: weight 0
    full = rng.standard_normal((2, 5, v)) * 3
    lp = full - np.log(np.exp(full).sum(-1, keepdims=True))
    lp = np.take_along_axis(lp, ids, -1)
    logits = rng.standard_normal((2, 5, n)) * 2
    kl, w = ttt_loss.kl_topk(jnp.asarray(ids), jnp.asarray(lp, jnp.float32), jnp.asarray(logits, jnp.float32),
                             jnp.asarray(index_of))
    ref_kl, ref_w = _kl_reference(ids, lp, logits, index_of)
    np.testing.assert_array_equal(np.asarray(w), ref_w)
    assert ref_w[0, 0] == 0 and ref_w.sum() >= 5
    np.testing.assert_allclose(np.asarray(kl), ref_kl, rtol=1e-4, atol=1e-5)
    # the full head: every token can be emitted, and q = p over the top k gives KL 0
    idx_all = ttt_loss.head_index(v)
    exact = np.full((1, v), -1e4)
    exact[0, ids[1, 1]] = lp[1, 1]
    kl0, _ = ttt_loss.kl_topk(jnp.asarray(ids[1:2, 1]), jnp.asarray(lp[1:2, 1], jnp.float32),
                              jnp.asarray(exact, jnp.float32), jnp.asarray(idx_all))
    assert abs(float(kl0[0])) < 1e-4


def test_training_unroll_drafts_what_the_loop_drafts():
    """With a trimmed head (its ids mapped back on both sides); the full head is the same chain."""
    seed = seeded_int(1 << 20)
    target, assistant = presets.tiny_pair(seed, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    tcfg = target.config
    assistant = models.with_draft_vocab(assistant, rng.permutation(tcfg.vocab_size)[:200])
    b, p, s, steps = 2, 6, 16, 3
    rows = jnp.asarray(rng.integers(3, tcfg.vocab_size, (b, s)), jnp.int32)
    cache = models.init_cache(tcfg, b, s, jnp.float32, ring=False)
    _, hidden, cache = jax.jit(models.forward)(target, rows, cache)
    t0, t1 = ttt_loss.ttt_queries(p, s, steps)
    drafts, logits = jax.jit(lambda a, c, h: ttt_loss.unrolled(a, target, rows, h, c, t0, t1, steps))(
        assistant, cache, hidden)
    def loop_drafts(a, c, bonus, h):  # propose reads these fields of the loop's DecodeState
        state = types.SimpleNamespace(cache=c, bonus=bonus, draft=h, counts=None, rows=None)
        return mtp.DEFAULT.propose(a, target, state, steps + 1, None, sampling.SamplingMode())[0]

    propose = jax.jit(loop_drafts)
    checked = 0
    for t in range(t0, t1):
        # the loop's state after committing tokens 0..t: bonus t+1, h_prev the target's hidden at t
        loop = np.asarray(propose(assistant, cache.replace(lengths=jnp.full((b,), t + 1, jnp.int32)), rows[:, t + 1],
                                  hidden[:, t]))
        lg = np.sort(np.stack([np.asarray(x[:, t - t0]) for x in logits], 1), -1)
        clear = (lg[..., -1] - lg[..., -2] > 1e-4).all(-1)  # no near tie anywhere in the row's chain
        np.testing.assert_array_equal(loop[clear], np.asarray(drafts[:, t - t0])[clear])
        checked += clear.sum()
    assert checked >= 0.8 * b * (t1 - t0)


@pytest.mark.slow
def test_ttt_trained_beats_untrained_with_greedy_parity(tmp_path):
    """The whole recipe at smoke size (CLI entry points): ~1.5 min on 2 cores, hence slow; the
    pieces it joins are covered above and in tests/drafters/test_trimmed_vocab.py."""
    from jaxspec.train import onpolicy_data, ttt
    seed = seeded_int(1 << 20)
    target, _ = presets.tiny_pair(seed, dtype=jnp.float32)
    models.save(target, str(tmp_path / "target"))
    common = ["--target", str(tmp_path / "target"), "--target-name", "tiny"]
    assert onpolicy_data.main(common + ["--work", str(tmp_path / "data"), "--random-prompts", "--prompts", "96",
                                        "--prompt-tokens", "16", "--new-tokens", "32", "--gen-batch", "32", "--sampled-share", "0.34",
                                        "--score-batch", "16", "--heldout-prompts", "4", "--seed", str(seed % 997)]) == 0
    z = np.load(tmp_path / "data" / "data.npz")
    assert z["rows"].shape == (96, 48) and z["top_ids"].shape == (96, 32, 16) and z["sampled"].sum() == 32
    # the greedy rows' tokens are the teacher's argmax (up to near ties), the sampled ones not always
    greedy = ~z["sampled"]
    assert (z["rows"][greedy, 16:] == z["top_ids"][greedy, :, 0]).mean() > 0.95
    out = tmp_path / "out"
    assert ttt.main(common + ["--data", str(tmp_path / "data"), "--out", str(out), "--draft-vocab", "256", "--ffn",
                              "128", "--batch", "8", "--steps", "240", "--warmup", "20", "--eval-every", "120",
                              "--eval-prompts", "4", "--eval-new-tokens", "24", "--lr", "3e-3", "--ce-weight", "0.5",
                              "--seed", str(seed % 997)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["evals"][0]["step"] == 0 and res["k_ran"] == 4
    untrained, best = res["evals"][0]["tokens_per_round"], max(e["tokens_per_round"] for e in res["evals"])
    assert best > untrained + 0.25, res["evals"]
    # the saved drafter (8-bit, reloaded) is the best one, measured on every held-out prompt
    assert res["heldout"]["all_identical"] and res["heldout"]["tokens_per_round"] > untrained + 0.2, res["heldout"]
    assert 0 < res["coverage"]["heldout"] <= 1 and res["coverage"]["draft_vocab"] == 256
    assert res["drafter"]["within_limit"] and os.path.isfile(out / "NOTICE")
