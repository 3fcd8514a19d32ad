"""Prompt-lookup (n-gram) drafting, `jaxspec.drafters.ngram`: the proposer against a plain-Python
reference; the loop with it is exactly classic decoding at T = 0 (ragged batches, K = 2..8, several
n ranges, a row that never matches), round by round as a host simulation of the drafter over the
classic tokens predicts, at the K asked; sampled output has the target's distribution (the
point-mass accept rule); a round is one program with no host round trip, and a new prompt compiles
nothing.
"""
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.engine import compile_cache
from jaxspec.engine import programs
from jaxspec.engine import sampling
from jaxspec.drafters import base, ngram
from support.seeds import seeded_int, seeded_rng
from support.pairs import pair
from support.ngram_ref import py_lookup
from support.distribution import N, PROMPT, SETTING, empirical, exact, tiny_pair, tv_threshold  # noqa: F401

G = importlib.import_module("jaxspec.engine.generate")


@pytest.mark.parametrize("n_min,n_max,m", [(1, 3, 3), (2, 2, 7), (1, 1, 1), (3, 5, 4)])
def test_lookup_matches_reference(n_min, n_max, m):
    rng = seeded_rng()
    b, c = 24, 40
    vocab = np.where(np.arange(b) < b // 2, 2, 1000)  # half the rows repeat a lot, half hardly at all
    hist = np.stack([rng.integers(0, v, c) for v in vocab]).astype(np.int32)
    length = rng.integers(1, c + 1, b).astype(np.int32)
    length[:3] = [1, n_min, c]  # no room for a match; exactly n tokens; the whole buffer
    hist[-1, :length[-1]] = np.arange(length[-1]) + 7  # distinct tokens: never matches
    drafts, n, start = jax.jit(ngram.lookup, static_argnums=(2, 3, 4))(jnp.asarray(hist), jnp.asarray(length), m,
                                                                        n_min, n_max)
    drafts, n, start = map(np.asarray, (drafts, n, start))
    for r in range(b):
        want_d, want_n, want_s = py_lookup(hist[r, :length[r]].tolist(), m, n_min, n_max)
        assert (drafts[r].tolist(), int(n[r])) == (want_d, want_n), r
        if want_n:
            assert start[r] == want_s, r
    assert n[-1] == 0 and n[0] == 0
    assert (n[3:b // 2] > 0).any()  # the repetitive rows match


def test_point_mass_accept_is_the_one_hot_rule():
    """sampling's point-mass path (q None) equals the general rule with q = one_hot(d), exactly, on
    random distributions, drafts and uniforms (the general rule's losslessness is tested in
    test_sampling.py); K = 1 (no drafts) draws from p."""
    rng = seeded_rng()
    b, v = 512, 8
    for k in (1, 2, 5):
        p = rng.dirichlet(np.full(v, 0.5), size=(b, k)).astype(np.float32)
        p[:b // 4, :, 0] = 0  # some drafts of probability 0
        p /= p.sum(-1, keepdims=True)
        d = rng.integers(0, v, (b, k - 1)).astype(np.int32)
        u, ur = rng.random((b, k - 1), np.float32), rng.random(b, np.float32)
        step = jax.jit(sampling.speculative_accept_from_uniforms)
        got = step(jnp.asarray(d), None, jnp.asarray(p), jnp.asarray(u), jnp.asarray(ur))
        want = step(jnp.asarray(d), jax.nn.one_hot(d, v, dtype=jnp.float32), jnp.asarray(p), jnp.asarray(u),
                    jnp.asarray(ur))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        if k > 1:
            assert 0 < np.asarray(got[0]).mean() < k - 1


def test_drafter_registry_and_errors():
    assert base.KINDS == ("mtp", "ngram", "hybrid")
    assert base.get("ngram").DEFAULT == ngram.Drafter()
    assert base.resolve(None, None) is None
    assert base.resolve("ngram", None).kind == "ngram"
    for bad, match in [("lookup", "unknown drafter 'lookup'"), (3, "drafter must be None")]:
        with pytest.raises(ValueError, match=match):
            base.resolve(bad, None)
    with pytest.raises(ValueError, match="'mtp' needs an assistant"):
        base.resolve("mtp", None)
    with pytest.raises(ValueError, match="'ngram' drafts without an assistant"):
        base.resolve("ngram", object())
    for kw, match in [(dict(n_min=0), "n_min must be an integer in 1..16"), (dict(n_max=17), "n_max must be"),
                      (dict(n_min=3, n_max=2), "n_min=3 is larger than n_max=2")]:
        with pytest.raises(ValueError, match=match):
            ngram.Drafter(**kw)


# ---------------------------------------------------------------------------------------------
# The loop: greedy == classic, round by round as the host simulation says


BUDGET = 32
REF = 48  # classic tokens past every row's budget: the drafts of a row's last round are compared with them


COPIES = 3  # rows whose prompt holds the start of its classic continuation
SEEN = 40   # classic tokens in such a prompt: the test model's greedy text is in a loop by then (its
            # next token is mostly a function of the current one: a walk on 256 ids repeats within
            # 40 steps but for ~4%), so the loop's next turns are drafted from the prompt


@pytest.fixture(scope="module")
def greedy_case():
    """A ragged batch of 4: prompts P + C, C the first SEEN classic tokens after P (drafts come from C
    in the prompt and from the row's own output), and a 2-token prompt with a budget of 3 (too short
    for any 3-gram to match); the rows' budgets and classic tokens. Both classic runs have one shape
    (a random 40-token row sets the first one's prompt width): one compiled program."""
    t, _ = pair()
    rng = seeded_rng()
    heads = rng.integers(0, 256, (COPIES, 6)).tolist()
    conts = jaxspec.generate(t, heads + [rng.integers(0, 256, SEEN).tolist()], max_new_tokens=REF,
                             eos_token_ids=[]).tokens
    rows = [h + c[:SEEN] for h, c in zip(heads, conts)] + [rng.integers(0, 256, 2).tolist()]
    classic = jaxspec.generate(t, rows, max_new_tokens=REF, eos_token_ids=[]).tokens
    return rows, [BUDGET, 28, 23, 3], classic


def simulate(rows, limits, classic, k, n_min, n_max):
    """The n-gram rounds on the host over the classic tokens (greedy drafts are accepted while they
    equal them): (accepted-length histogram, per row [matched rounds, accepted from the prompt,
    accepted from the output])."""
    hist, per_row = [0] * k, []
    for prompt, limit, full in zip(rows, limits, classic):
        n, counts = 1, [0, 0, 0]
        while n < limit:
            drafts, found, start = py_lookup(prompt + full[:n], k - 1, n_min, n_max)
            a = 0
            while a < k - 1 and drafts[a] == full[n + a]:
                a += 1
            hist[a] += 1
            if found:
                counts[0] += 1
                counts[1 if start < len(prompt) else 2] += a
            n += min(a + 1, limit - n)
        per_row.append(counts)
    return hist, per_row


@pytest.mark.parametrize("k,n_min,n_max", [(2, 1, 3), (3, 2, 2), (4, 1, 1), (4, 3, 5), (8, 2, 4)])
def test_greedy_equals_classic(greedy_case, k, n_min, n_max):
    t, _ = pair()
    rows, limits, classic = greedy_case
    drafter = ngram.Drafter(n_min=n_min, n_max=n_max)
    # The classic runs' buffer (so their prefill is this one's), smaller budgets per row. Without the
    # exactness probe, whose fallback test_generate.py tests: here K runs as asked, or the test fails.
    p = G.plan(t, rows, G.request_of(max_new_tokens=REF), block_size=k, eos_token_ids=[], drafter=drafter,
               exactness_probe=False)
    limit = jnp.asarray(limits, jnp.int32)
    state, pre_s, dec_s = p.gen.run(t, p.params, *p.inputs[:3], limit, *p.inputs[4:])
    r = p.result(state, pre_s, dec_s)
    assert r.tokens == [c[:n] for c, n in zip(classic, limits)]
    s = r.stats
    assert (s.mode, s.drafter, s.block_size, s.fallback) == ("speculative", "ngram", k, None)  # the K asked ran
    assert s.drafted == (k - 1) * s.row_rounds
    hist, per_row = simulate(rows, limits, classic, k, n_min, n_max)
    assert s.accepted_hist == hist
    d = jax.device_get(state.draft)
    assert np.stack([d.matched, d.from_prompt, d.from_output], 1).tolist() == per_row
    assert s.draft_stats == dict(zip(("matched_rounds", "accepted_from_prompt", "accepted_from_output"),
                                     np.sum(per_row, 0).tolist()))
    if n_min >= 3:
        assert per_row[-1][0] == 0  # the short row never matched (and still decoded exactly)
    # drafts were accepted (from the prompt or the row's output: once the output has looped, its latest
    # occurrence is in the output, so which source wins depends on the seed; the exact counts are simulate's)
    assert sum(c[1] + c[2] for c in per_row[:COPIES]) > 0
    if k == 4:
        _one_program_per_shape(t, p, rows, state)


def _one_program_per_shape(t, p, rows, state):
    """The decode is one while loop with no host round trip in it, and other prompts of the same
    shapes (new tokens, lengths, budgets) compile nothing."""
    hlo = p.gen.compiled_decode_text(t, None, state)
    assert hlo.count(" while(") >= 1
    for bad in ("outfeed", "infeed", " send(", " recv(", "host_callback", "xla_python_cpu_callback",
                "xla_ffi_python"):
        assert bad not in hlo, bad
    other = [list(reversed(r)) for r in rows]
    with compile_cache.CompileLog() as log:
        r = jaxspec.generate(t, other, max_new_tokens=REF, block_size=4, eos_token_ids=[], drafter=p.gen.spec.drafter,
                             exactness_probe=False)
    assert r.stats.drafter == "ngram" and r.stats.block_size == 4
    assert [q.name for q in log.programs if q.lower_s or q.compile_s] == []


# ---------------------------------------------------------------------------------------------
# Sampling: the target's distribution


def _sampled_tv(t, exact):  # noqa: F811  (the fixture, passed on)
    r = jaxspec.generate(t, [PROMPT] * N, drafter="ngram", max_new_tokens=3, block_size=3,
                         seed=seeded_int(1 << 30), eos_token_ids=[], **SETTING)
    assert (r.stats.drafter, r.stats.block_size) == ("ngram", 3)
    emp = empirical(r.tokens)
    tv = 0.5 * np.abs(emp - exact).sum()
    thr = tv_threshold(exact, seeded_rng())
    print(f"ngram K=3: TV {tv:.4f} (threshold {thr:.4f}), hist {r.stats.accepted_hist}, {r.stats.draft_stats}")
    return emp, tv, thr, r.stats.accepted_hist


def test_sampled_first_three_tokens_match_target_distribution(tiny_pair, exact):  # noqa: F811
    """The exhaustive first-3-token distribution of a V = 8 target (test_sampling_generate's
    reference) against 4000 sampled rows decoded with n-gram drafts at K = 3."""
    emp, tv, thr, hist = _sampled_tv(tiny_pair[0], exact)
    assert np.all(emp[exact == 0] == 0), "a sequence of probability 0 was generated"
    assert tv < thr
    assert hist[0] > 0 and hist[-1] > 0  # rejections and full acceptance both occur


def test_statistic_rejects_a_point_mass_loop_that_keeps_the_draft(tiny_pair, exact, monkeypatch):  # noqa: F811
    """Power: a loop that resamples from p after rejecting d (instead of p with d removed) emits the
    drafted tokens too often; the same statistic must catch it."""
    monkeypatch.setattr(sampling, "residual_probs", lambda p, q: p / jnp.sum(p, axis=-1, keepdims=True))
    monkeypatch.setattr(G, "_GENERATORS", {})
    monkeypatch.setattr(G, "_jits", functools.lru_cache(maxsize=None)(G._jits.__wrapped__))  # traced anew
    monkeypatch.setattr(programs, "_MEMO", {k: v for k, v in programs._MEMO.items() if k[0] == "prefill"})
    _, tv, thr, _ = _sampled_tv(tiny_pair[0], exact)
    assert tv > thr
