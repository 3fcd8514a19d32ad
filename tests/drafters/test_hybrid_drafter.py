"""The hybrid drafter (`jaxspec.drafters.hybrid`: prompt lookup where a row's last n-gram matches,
the MTP assistant otherwise): greedy output is classic decoding's with both kinds of rounds in one
batch, at the K asked; a copying row's rounds are lookup rounds as a host reference of the rule
says; a round where every row matched or is done skips the assistant (the branch the loop's
conditional took, counted); sampled output has the target's distribution with rows of both kinds
in one batch.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.drafters import base, hybrid
from support.ngram_ref import py_lookup
from support.distribution import N, PROMPT, SETTING, empirical, exact, tiny_pair, tv_threshold  # noqa: F401
from support.pairs import pair
from support.seeds import seeded_int, seeded_rng

G = importlib.import_module("jaxspec.engine.generate")
K, BUDGET = 4, 24
REF = BUDGET + K  # classic tokens past the budget: a last round's drafts are compared with them
SEEN = 40  # classic tokens the copying row's prompt holds (the test model's greedy text loops by then)


def lookup_rounds(prompt, full, limit):
    """The lookup rounds of a row that copies its prompt, on the host (drafts accepted while they equal
    the classic tokens `full`): how many rounds reach `limit` tokens, or None when a round would find
    no match (the assistant would draft it)."""
    n, rounds = 1, 0
    while n < limit:
        drafts, found, _ = py_lookup(prompt + full[:n], K - 1, hybrid.N_MIN, hybrid.Drafter().n_max)
        if not found:
            return None
        acc = 0
        while acc < K - 1 and drafts[acc] == full[n + acc]:
            acc += 1
        n += min(acc + 1, limit - n)
        rounds += 1
    return rounds


@pytest.fixture(scope="module")
def case():
    """A row whose prompt holds the start of its own classic continuation, chosen so that the lookup
    rule matches at the start of every round (the host says so), a random row whose first round finds
    no match, and their classic tokens (one batch, one program for every candidate)."""
    t, a = pair()
    rng = seeded_rng()
    for _ in range(16):
        head = rng.integers(0, 256, 6).tolist()
        cont = jaxspec.generate(t, [head], max_new_tokens=SEEN, eos_token_ids=[]).tokens[0]
        rows = [head + cont, rng.integers(0, 256, 9).tolist()]
        classic = jaxspec.generate(t, rows, max_new_tokens=REF, eos_token_ids=[]).tokens
        rounds = lookup_rounds(rows[0], classic[0], BUDGET)
        if rounds is not None and not py_lookup(rows[1] + classic[1][:1], K - 1, hybrid.N_MIN, 3)[1]:
            return t, a, rows, classic, rounds
    pytest.fail("no copying row whose every round matches in 16 draws")


def test_greedy_equals_classic_with_both_kinds_of_round(case):
    t, a, rows, classic, _ = case
    # without the exactness probe (its fallback is test_generate's): K runs as asked or the test fails
    r = jaxspec.generate(t, rows, assistant=a, max_new_tokens=BUDGET, eos_token_ids=[], drafter=hybrid.Drafter(),
                         block_size=K, exactness_probe=False)
    assert r.tokens == [c[:BUDGET] for c in classic]
    s = r.stats
    assert (s.mode, s.drafter, s.block_size, s.fallback) == ("speculative", "hybrid", K, None)
    d = s.draft_stats
    assert d["matched_rounds"] > 0 and d["assisted_rounds"] > 0
    assert d["matched_rounds"] + d["assisted_rounds"] == s.row_rounds


def test_the_assistant_is_skipped_where_every_row_matched_or_is_done(case):
    """The copying row beside the random row with a budget of 2 tokens (done after its first round):
    the copying row's rounds are all lookup rounds, as many as the host rule says; the first round
    runs the assistant (for the random row), every later one skips it (the only other row is done),
    as the branch the loop's conditional took counts."""
    t, a, rows, classic, rounds = case
    p = G.plan(t, rows, G.request_of(max_new_tokens=BUDGET), assistant=a, block_size=K, eos_token_ids=[],
               drafter="hybrid", exactness_probe=False)
    limit = jnp.asarray([BUDGET, 2], jnp.int32)
    state, pre_s, dec_s = p.gen.run(t, p.params, *p.inputs[:3], limit, *p.inputs[4:])
    r = p.result(state, pre_s, dec_s)
    assert r.tokens == [classic[0][:BUDGET], classic[1][:2]]
    assert (r.stats.drafter, r.stats.block_size) == ("hybrid", K)
    d = jax.device_get(state.draft)
    assert d.lookup.matched.tolist() == [rounds, 0] and d.assisted.tolist() == [0, 1]
    assert d.skipped.tolist() == [rounds - 1, 0]
    assert " conditional(" in p.gen.compiled_decode_text(t, p.params, state)


def test_registry_and_errors():
    assert "hybrid" in base.KINDS and base.get("hybrid").DEFAULT == hybrid.Drafter()
    with pytest.raises(ValueError, match="'hybrid' needs an assistant"):
        base.resolve("hybrid", None)
    for kw, match in [(dict(n_min=0), "hybrid n_min must be an integer in 1..16"), (dict(n_min=3, n_max=2), "larger")]:
        with pytest.raises(ValueError, match=match):
            hybrid.Drafter(**kw)


def test_sampled_first_three_tokens_match_target_distribution(tiny_pair, exact):  # noqa: F811
    """The exhaustive first-3-token distribution of a V = 8 target against 4000 rows at K = 3, rows
    drafted by lookup (q = one_hot) and by the assistant (its q) in the same batch."""
    t, a = tiny_pair
    r = jaxspec.generate(t, [PROMPT] * N, assistant=a, drafter=hybrid.Drafter(n_min=1), max_new_tokens=3,
                         block_size=3, seed=seeded_int(1 << 30), eos_token_ids=[], **SETTING)
    assert (r.stats.drafter, r.stats.block_size) == ("hybrid", 3)
    d = r.stats.draft_stats
    assert d["matched_rounds"] > 0 and d["assisted_rounds"] > 0, d
    emp = empirical(r.tokens)
    tv = 0.5 * np.abs(emp - exact).sum()
    thr = tv_threshold(exact, seeded_rng())
    print(f"hybrid K=3: TV {tv:.4f} (threshold {thr:.4f}), hist {r.stats.accepted_hist}, {d}")
    assert np.all(emp[exact == 0] == 0), "a sequence of probability 0 was generated"
    assert tv < thr


def test_penalties_and_bias_keep_greedy_exact(case):
    """Greedy with presence / repetition penalties and a logit bias (the verify penalises each
    position with the counts plus the drafts before it, whichever drafter made them): classic's tokens."""
    t, a, rows, _, _ = case
    knobs = dict(max_new_tokens=BUDGET, eos_token_ids=[], presence_penalty=0.5, repetition_penalty=1.2,
                 logit_bias={int(rows[1][0]): 4.0})
    classic = jaxspec.generate(t, rows, **knobs)
    r = jaxspec.generate(t, rows, assistant=a, drafter="hybrid", block_size=K, exactness_probe=False, **knobs)
    assert r.tokens == classic.tokens
    d = r.stats.draft_stats
    assert (r.stats.drafter, r.stats.block_size) == ("hybrid", K) and d["assisted_rounds"] > 0, d
