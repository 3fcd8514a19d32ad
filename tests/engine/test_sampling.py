"""jaxspec.engine.sampling against independent numpy references.

- filtering (temperature, top-k, top-p) against a direct numpy implementation;
- the inverse-CDF sampler and the block accept/resample step against their formulas, exactly, with
  the uniforms passed in;
- losslessness of modified rejection sampling on a Markov-chain "model" pair: the distribution of
  the first three emitted tokens equals the target chain's, by a chi-square test, and the same test
  rejects a subtly wrong q (so it has power).
"""
import zlib

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from scipy import stats as sstats

from jaxspec.engine import sampling
from support.seeds import seeded_rng
from support.sampling_ref import np_filter_probs  # noqa: F401


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 12, 0.6), (2.0, 3, 0.99), (1.0, None, 0.05),
])
def test_filter_matches_numpy(temperature, top_k, top_p):
    rng = np.random.default_rng(zlib.crc32(repr((temperature, top_k, top_p)).encode()))
    logits = rng.normal(size=(7, 50)).astype(np.float32) * 3
    params = sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    mode = params.mode()
    rows = sampling.row_params([params] * len(logits), mode)
    got = np.asarray(jax.jit(sampling.probs_from_logits, static_argnums=2)(jnp.asarray(logits), rows, mode))
    want = np_filter_probs(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same support, exactly
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert np.all((want > 0).sum(-1) >= 1)
    if top_k is not None and top_p is None:
        assert np.all((got > 0).sum(-1) == top_k)  # continuous logits: no ties


def test_sampling_params_validation():
    for bad in (dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=1.0, top_p=0.0),
                dict(temperature=1.0, top_p=1.5), dict(temperature=1.0, top_k=0),
                dict(temperature=1.0, draft="nope")):
        with pytest.raises(ValueError):
            sampling.SamplingParams(**bad)
    assert sampling.SamplingParams().greedy and not sampling.SamplingParams(temperature=0.5).greedy
    for bad in (dict(temperature=1.0, top_k=True), dict(temperature=1.0, top_k=2.0), dict(temperature=True)):
        with pytest.raises(ValueError):
            sampling.SamplingParams(**bad)
    # numpy numbers are numbers; top_k is kept as a Python int (equal, hashable, static)
    p = sampling.SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))
    assert p == sampling.SamplingParams(temperature=0.5, top_k=3, top_p=0.9) and type(p.top_k) is int


def test_seed_key():
    """Seeds in [0, 2**64) map to the key data [seed >> 32, seed & 0xFFFFFFFF] (jax.random.key's own
    for seeds < 2**32); anything else is a ValueError naming the range."""
    data = lambda s: jax.random.key_data(sampling.seed_key(s)).tolist()
    assert data(0) == [0, 0] and data(7) == jax.random.key_data(jax.random.key(7)).tolist()
    assert data(2**32) == [1, 0] and data(np.uint64(2**64 - 1)) == [2**32 - 1, 2**32 - 1]
    assert sampling.validate_seed(np.int16(9)) == 9 and type(sampling.validate_seed(np.int16(9))) is int
    for bad in (-1, 2**64, 2.0**63, True, np.bool_(False), "1", None):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            sampling.seed_key(bad)
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            sampling.seed_key_data(bad)
    rng = seeded_rng()
    for s in [0, 7, 2**32, 2**64 - 1, *map(int, rng.integers(0, 2**63, 4, dtype=np.int64))]:
        host = sampling.seed_key_data(s)  # what the batch engine's admission uses, computed on the host
        assert host.dtype == np.uint32 and host.tolist() == data(s), s


def test_host_row_params_equal_the_device_ones():
    """row_params(xp=np) (the batch engine's admission) holds the values and dtypes the device arrays do."""
    params = [sampling.SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logit_bias=((3, 1.5),),
                                      presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.3),
              sampling.SamplingParams()]
    mode = params[0].mode()
    host, dev = sampling.row_params(params, mode, xp=np), jax.device_get(sampling.row_params(params, mode))
    for name in host.__dataclass_fields__:
        h, d = getattr(host, name), getattr(dev, name)
        assert isinstance(h, np.ndarray) and h.dtype == d.dtype and np.array_equal(h, d), name


def np_inverse_cdf(p, u):
    cdf = np.cumsum(np.asarray(p, np.float64))
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


def test_sample_from_probs_exact():
    rng = np.random.default_rng(1)
    p = rng.random((64, 9)).astype(np.float32)
    p[rng.random(p.shape) < 0.4] = 0
    p[:, 2] += 0.05  # every row has mass
    p[:, -2:] = 0    # trailing zeros: the top end must never land there
    u = rng.random(64).astype(np.float32)
    u[:4] = np.float32(1 - 2**-24)
    u[4:6] = 0.0
    got = np.asarray(jax.jit(sampling.sample_from_probs)(jnp.asarray(p), jnp.asarray(u)))
    cdf = np.cumsum(p.astype(np.float64), -1)
    checked = 0
    for r in range(64):
        assert p[r, got[r]] > 0
        if np.min(np.abs(cdf[r] - u[r] * cdf[r, -1])) < 1e-5 * cdf[r, -1]:
            continue  # boundary case: float32 vs float64 cumsum may legitimately differ
        want = min(np_inverse_cdf(p[r], u[r]), int(np.flatnonzero(p[r])[-1]))
        assert got[r] == want, r
        checked += 1
    assert checked > 50


def _random_block(rng, b, k, v, zero_frac=0.3):
    p = rng.random((b, k, v)) ** 3
    p[rng.random(p.shape) < zero_frac] = 0
    p[..., 0] += 1e-3
    p /= p.sum(-1, keepdims=True)
    q = rng.random((b, k - 1, v)) ** 2
    q[rng.random(q.shape) < zero_frac] = 0
    q[..., 1] += 1e-3
    q /= q.sum(-1, keepdims=True)
    d = np.stack([[rng.choice(v, p=q[i, j]) for j in range(k - 1)] for i in range(b)]).astype(np.int32)
    return p.astype(np.float32), q.astype(np.float32), d


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accept_step_matches_formula(k):
    """Deterministic given the uniforms: accept iff u < p(d)/q(d); a = leading accepts; the token at a
    is the inverse CDF of normalize(max(0, p_a - q_a)) (p_{K-1} when all accepted)."""
    rng = np.random.default_rng(10 + k)
    b, v = 300, 7
    if k == 1:
        p = rng.random((b, 1, v)).astype(np.float32)
        p /= p.sum(-1, keepdims=True)
        q = np.zeros((b, 0, v), np.float32)
        d = np.zeros((b, 0), np.int32)
    else:
        p, q, d = _random_block(rng, b, k, v)
    u_acc = rng.random((b, k - 1)).astype(np.float32)
    u_res = rng.random(b).astype(np.float32)
    fn = jax.jit(sampling.speculative_accept_from_uniforms)
    n_acc, emitted = map(np.asarray, fn(jnp.asarray(d), jnp.asarray(q), jnp.asarray(p),
                                        jnp.asarray(u_acc), jnp.asarray(u_res)))
    hist = np.zeros(k, int)
    for r in range(b):
        a = 0
        while a < k - 1:
            ratio = float(p[r, a, d[r, a]]) / float(q[r, a, d[r, a]])
            assert abs(ratio - u_acc[r, a]) > 1e-6  # no boundary ties in this draw
            if not u_acc[r, a] < min(1.0, ratio):
                break
            a += 1
        assert n_acc[r] == a, r
        hist[a] += 1
        pa = p[r, a].astype(np.float64)
        qa = q[r, a].astype(np.float64) if a < k - 1 else np.zeros(v)
        res = np.maximum(pa - qa, 0)
        res = res / res.sum()
        got_res = np.asarray(sampling.residual_probs(jnp.asarray(p[r, a]), jnp.asarray(qa.astype(np.float32))))
        np.testing.assert_allclose(got_res, res, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(emitted[r, :a], d[r, :a])
        cdf = np.cumsum(res)
        if np.min(np.abs(cdf - u_res[r])) > 1e-5:
            assert emitted[r, a] == np_inverse_cdf(res, u_res[r]), r
        assert res[emitted[r, a]] > 0
    if k > 1:
        assert hist[0] > 0 and hist[k - 1] > 0  # both rejection and full acceptance exercised


def test_greedy_walk():
    rng = np.random.default_rng(3)
    b, k, v = 200, 5, 6
    logits = rng.normal(size=(b, k, v)).astype(np.float32)
    am = logits.argmax(-1)
    d = np.where(rng.random((b, k - 1)) < 0.7, am[:, : k - 1], rng.integers(0, v, (b, k - 1))).astype(np.int32)
    n_acc, emitted = map(np.asarray, sampling.greedy_accept(jnp.asarray(d), jnp.asarray(logits)))
    for r in range(b):
        a = next((i for i in range(k - 1) if d[r, i] != am[r, i]), k - 1)
        assert n_acc[r] == a
        np.testing.assert_array_equal(emitted[r, : a + 1], np.r_[d[r, :a], am[r, a]])
    assert len(set(n_acc.tolist())) == k


# ---------------------------------------------------------------------------------------------
# Losslessness on Markov chains: target p(.|prev), draft q(.|prev).


def _simulate_markov(key, P, Q_draw, Q_claim, start, n_chains, k, n_tokens=3):
    """Run speculative decoding with block size k on order-1 Markov chains, vectorized over chains.
    Drafts are drawn from Q_draw; the accept step is told Q_claim (== Q_draw when correct)."""
    P, Q_draw, Q_claim = map(jnp.asarray, (P, Q_draw, Q_claim))
    width = n_tokens + k

    def one_round(carry, key):
        out, n, last = carry
        kd, ka = jax.random.split(key)
        toks, cur = [], last
        for i, kk in enumerate(jax.random.split(kd, k - 1)):
            cur = jax.random.categorical(kk, jnp.log(Q_draw[cur]))
            toks.append(cur)
        d = jnp.stack(toks, 1).astype(jnp.int32) if k > 1 else jnp.zeros((n_chains, 0), jnp.int32)
        prevs = jnp.concatenate([last[:, None], d], 1)  # context of each verify position
        p = P[prevs]                                    # [N, k, V]
        q = Q_claim[prevs[:, : k - 1]]                  # [N, k-1, V]
        n_acc, emitted = sampling.speculative_accept(ka, d, q, p)
        out = jax.vmap(lambda o, e, s: jax.lax.dynamic_update_slice(o, e, (s,)))(out, emitted, n)
        n = n + n_acc + 1
        last = jnp.take_along_axis(emitted, n_acc[:, None], 1)[:, 0]
        return (out, n, last), None

    init = (jnp.zeros((n_chains, width), jnp.int32), jnp.zeros(n_chains, jnp.int32),
            jnp.full((n_chains,), start, jnp.int32))
    (out, n, _), _ = jax.lax.scan(one_round, init, jax.random.split(key, n_tokens))
    return out[:, :n_tokens]


def _chi2_pvalue(seqs, P, start, v):
    codes = seqs[:, 0] * v * v + seqs[:, 1] * v + seqs[:, 2]
    counts = np.bincount(codes, minlength=v ** 3).astype(np.float64)
    exact = np.einsum("a,ab,bc->abc", P[start], P, P).reshape(-1)
    mask = exact > 0
    assert counts[~mask].sum() == 0, "a zero-probability sequence was generated"
    expected = exact[mask] * len(seqs)
    chi2 = ((counts[mask] - expected) ** 2 / expected).sum()
    tv = 0.5 * np.abs(counts / len(seqs) - exact).sum()
    return sstats.chi2.sf(chi2, mask.sum() - 1), tv


@pytest.mark.parametrize("k", [2, 4])
def test_rejection_sampling_is_lossless_markov(k):
    rng = np.random.default_rng(100 + k)
    v, n = 5, 60000
    P = rng.random((v, v)) ** 2
    P[rng.random((v, v)) < 0.2] = 0
    P[:, 0] += 0.02
    P /= P.sum(1, keepdims=True)
    Q = 0.5 * P + 0.5 * rng.dirichlet(np.ones(v), size=v)  # related but different draft
    sim = jax.jit(_simulate_markov, static_argnums=(4, 5, 6))
    seqs = np.asarray(sim(jax.random.key(k), P, Q, Q, 1, n, k))
    pval, tv = _chi2_pvalue(seqs, P, 1, v)
    print(f"k={k}: chi2 p-value {pval:.3g}, TV {tv:.4f}")
    assert pval > 1e-4, (pval, tv)
    # Power check: the same test rejects the step when it is told a slightly wrong q
    # (q mixed 15% towards uniform), a subtle bug.
    wrong = 0.85 * Q + 0.15 / v
    seqs_bad = np.asarray(sim(jax.random.key(k), P, Q, wrong, 1, n, k))
    pval_bad, tv_bad = _chi2_pvalue(seqs_bad, P, 1, v)
    print(f"k={k}: wrong-q chi2 p-value {pval_bad:.3g}, TV {tv_bad:.4f}")
    assert pval_bad < 1e-6, (pval_bad, tv_bad)


def test_draft_choice_argmax_is_one_hot():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(4, 11)).astype(np.float32))
    params = sampling.SamplingParams(temperature=0.8, top_k=4, draft="argmax")
    tok, q = sampling.draft_choice(jax.random.key(0), logits, sampling.row_params([params] * 4, params.mode()),
                                   params.mode())
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(logits).argmax(-1))
    np.testing.assert_array_equal(np.asarray(q), np.eye(11)[np.asarray(logits).argmax(-1)])
    params = sampling.SamplingParams(temperature=0.8, top_k=4)
    tok, q = sampling.draft_choice(jax.random.key(0), logits, sampling.row_params([params] * 4, params.mode()),
                                   params.mode())
    assert np.all(np.asarray(q)[np.arange(4), np.asarray(tok)] > 0)
    np.testing.assert_allclose(np.asarray(q), np_filter_probs(np.asarray(logits), 0.8, 4), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("top_p", [1.2e-38, 1e-38, 1e-40, 1e-45, 5e-324])
def test_a_top_p_below_float32s_normal_range_keeps_the_filter(top_p):
    """top_p is in (0, 1]: one too small for float32 (subnormal, or 0 once converted; XLA may flush
    subnormals to zero) still keeps only the most likely token, as the float64 reference does, not
    every token (issue 51)."""
    rng = np.random.default_rng(zlib.crc32(repr(top_p).encode()))
    logits = rng.normal(size=(5, 40)).astype(np.float32) * 3
    params = sampling.SamplingParams(temperature=1.0, top_p=top_p)
    mode = params.mode()
    rows = sampling.row_params([params] * len(logits), mode)
    got = np.asarray(jax.jit(sampling.probs_from_logits, static_argnums=2)(jnp.asarray(logits), rows, mode))
    want = np_filter_probs(logits, 1.0, None, top_p)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert np.all((want > 0).sum(-1) == 1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 12, None), (1.3, None, 0.8),
                                                     (0.9, 6, 0.9)])
def test_min_p_matches_numpy(temperature, top_k, top_p):
    """min_p (issue 55) against its definition in float64: each row its own min_p (a runtime value:
    0 is off, 1 keeps only the most likely token), alone and with top-k / top-p."""
    rng = np.random.default_rng(zlib.crc32(repr(("min_p", temperature, top_k, top_p)).encode()))
    logits = rng.normal(size=(7, 50)).astype(np.float32) * 3
    min_p = np.concatenate([[0.0, 1.0], rng.uniform(0.001, 0.6, 5)])
    params = [sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=float(m))
              for m in min_p]
    mode = sampling.SamplingMode(sample=True, filter=True)
    rows = sampling.row_params(params, mode)
    got = np.asarray(jax.jit(sampling.probs_from_logits, static_argnums=2)(jnp.asarray(logits), rows, mode))
    want = np_filter_probs(logits, temperature, top_k, top_p, min_p)
    np.testing.assert_array_equal(got > 0, want > 0)  # the same support, exactly
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    assert (got[1] > 0).sum() == 1 and np.argmax(got[1]) == np.argmax(logits[1])
    np.testing.assert_array_equal(got[0] > 0, np_filter_probs(logits[:1], temperature, top_k, top_p)[0] > 0)
    assert (want[2:] > 0).sum() < (np_filter_probs(logits[2:], temperature, top_k, top_p) > 0).sum()  # it bites
    assert sampling.SamplingParams(temperature=1.0, min_p=0.1).mode().filter
    assert not sampling.SamplingParams(temperature=1.0, min_p=0.0).mode().filter
    for bad in (-0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match=r"min_p must be None or a number in \[0.0, 1.0\]"):
            sampling.SamplingParams(temperature=1.0, min_p=bad)
