"""Lossless speculative sampling end to end: the distribution of the first three generated tokens
equals the target's own (exact, by enumerating a tiny vocabulary), for speculative sampling with
sampled drafts and with argmax drafts, and for classic sampling; the same statistic rejects a loop
with a plausible bug (resampling from p instead of the residual on rejection).
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
from jaxspec.engine import programs
from jaxspec.engine import sampling
from support.sampling_ref import np_filter_probs
from support.distribution import V_, N, PROMPT, SETTING, tiny_pair, exact, empirical, tv_threshold  # noqa: F401

G = importlib.import_module("jaxspec.engine.generate")


def _generate(t, a, k, draft="sample", seed=1):
    # eos_token_ids=[]: the reference is the distribution of the first three tokens, with no stopping
    # on the config's EOS id.
    return jaxspec.generate(t, [PROMPT] * N, assistant=a if k > 1 else None, max_new_tokens=3, block_size=k,
                            seed=seed, draft=draft, eos_token_ids=[], **SETTING)


@pytest.mark.parametrize("k,draft", [(1, "sample"), (3, "sample"), (3, "argmax")])
def test_first_three_tokens_match_target_distribution(tiny_pair, exact, monkeypatch, k, draft):
    t, a = tiny_pair
    monkeypatch.setattr(importlib.import_module("jaxspec.engine.verify"), "exactness_probe",
                        lambda *x, **kw: pytest.fail("the exactness probe is only for greedy decoding"))
    r = _generate(t, a, k, draft)
    emp = empirical(r.tokens)
    assert np.all(emp[exact == 0] == 0), "a sequence of probability 0 was generated"
    tv = 0.5 * np.abs(emp - exact).sum()
    thr = tv_threshold(exact, np.random.default_rng(0))
    print(f"K={k} draft={draft}: TV {tv:.4f} (threshold {thr:.4f}), "
          f"acceptance {r.stats.acceptance_rate:.2f}, hist {r.stats.accepted_hist}")
    assert tv < thr
    if k > 1:
        assert r.stats.mode == "speculative"
        hist = r.stats.accepted_hist
        assert hist[0] > 0 and hist[-1] > 0  # rejections and full acceptance both occur


def test_statistic_rejects_a_biased_loop(tiny_pair, exact, monkeypatch):
    """Power: a loop that resamples from p (instead of normalize(max(0, p - q))) after a rejection
    over-produces draft tokens; the same TV test must catch it."""
    t, a = tiny_pair

    monkeypatch.setattr(sampling, "speculative_accept", _biased_accept)
    monkeypatch.setattr(G, "_GENERATORS", {})
    monkeypatch.setattr(G, "_jits", functools.lru_cache(maxsize=None)(G._jits.__wrapped__))  # traced anew
    monkeypatch.setattr(programs, "_MEMO", {k: v for k, v in programs._MEMO.items() if k[0] == "prefill"})
    r = _generate(t, a, 3)
    emp = empirical(r.tokens)
    tv = 0.5 * np.abs(emp - exact).sum()
    thr = tv_threshold(exact, np.random.default_rng(0))
    print(f"biased loop: TV {tv:.4f} (threshold {thr:.4f})")
    assert tv > thr


def _biased_accept(key, draft_tokens, q, p):
    b, k, v = p.shape
    k_acc, k_res = jax.random.split(key)
    u_accept = jax.random.uniform(k_acc, (b, k - 1), jnp.float32)
    u_resample = jax.random.uniform(k_res, (b,), jnp.float32)
    n_acc, _ = sampling.speculative_accept_from_uniforms(draft_tokens, q, p, u_accept, u_resample)
    tok = sampling.sample_from_probs(p[jnp.arange(b), n_acc], u_resample)  # the bug: p, not the residual
    pos = jnp.arange(k)[None, :]
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((b, 1), jnp.int32)], 1)
    return n_acc, jnp.where(pos < n_acc[:, None], drafts, tok[:, None]).astype(jnp.int32)


MIN_P = dict(temperature=0.9, min_p=0.1)


def test_min_p_speculative_sampling_follows_the_filtered_target(tiny_pair):
    """min_p (issue 55), end to end, in one run of the program the tests above compile (K = 3,
    sampled drafts, a filtering program, N rows): rows 1.. sample with min_p and their first three
    tokens follow the target's min_p-filtered distribution (exact enumeration, the float64
    reference); row 0 is greedy with min_p set and is exactly classic decoding (the argmax chain of
    the target's logits)."""
    t, a = tiny_pair
    x1, x2 = np.meshgrid(np.arange(V_), np.arange(V_), indexing="ij")
    ids = np.concatenate([np.tile(PROMPT, (V_ * V_, 1)), x1.reshape(-1, 1), x2.reshape(-1, 1)], 1)
    logits = np.asarray(jax.jit(models.logits)(t, jnp.asarray(ids, jnp.int32)), np.float64)
    n = len(PROMPT)
    f = lambda lg: np_filter_probs(lg, MIN_P["temperature"], min_p=MIN_P["min_p"])  # noqa: E731
    joint = (f(logits[:1, n - 1])[0][:, None, None] * f(logits[::V_, n]).reshape(V_, V_)[:, :, None]
             * f(logits[:, n + 1]).reshape(V_, V_, V_)).reshape(-1)
    assert abs(joint.sum() - 1) < 1e-9 and (f(logits[:1, n - 1]) == 0).sum() >= 2  # min_p drops tokens here

    gen = jaxspec.make_generate(block_size=3, max_new_tokens=G.BUDGET_BUCKET, verify_pad=False,
                                mode=sampling.SamplingMode(sample=True, filter=True))
    params = [sampling.SamplingParams(temperature=0.0, min_p=0.5)] + [sampling.SamplingParams(**MIN_P)] * (N - 1)
    state, _, _ = gen.run(t, a, *gen.inputs([PROMPT] * N, max_new_tokens=3, seed=5, params=params))
    tokens = gen.tokens(state)
    g1 = int(np.argmax(logits[0, n - 1]))
    g2 = int(np.argmax(logits[g1 * V_, n]))
    g3 = int(np.argmax(logits[g1 * V_ + g2, n + 1]))
    assert tokens[0] == [g1, g2, g3]

    seqs = np.asarray([r[:3] for r in tokens[1:]])
    emp = np.bincount(seqs[:, 0] * V_ * V_ + seqs[:, 1] * V_ + seqs[:, 2], minlength=V_ ** 3) / (N - 1)
    assert np.all(emp[joint == 0] == 0), "a token min_p drops was generated"
    draws = np.random.default_rng(0).multinomial(N - 1, joint, size=400) / (N - 1)
    thr = np.quantile(0.5 * np.abs(draws - joint).sum(1), 0.999) * 1.1  # as tv_threshold, at N - 1 samples
    tv = 0.5 * np.abs(emp - joint).sum()
    accepted = np.asarray(state.accepted)[1:].sum() / np.asarray(state.drafted)[1:].sum()
    print(f"min_p: TV {tv:.4f} (threshold {thr:.4f}), acceptance {accepted:.2f}")
    assert tv < thr and 0 < accepted < 1  # rejections and acceptances both occur
