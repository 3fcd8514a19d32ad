"""The hybrid drafter (`jaxspec.drafters.hybrid`: prompt lookup where a row's last n-gram matches,
the MTP assistant otherwise): greedy output is classic decoding's with both kinds of rounds in one
ragged batch, at the K asked; every round of a row is one kind or the other, chosen by the lookup
rule (a host reference of it over the rows' own tokens); a round where every row matched skips the
assistant (one `conditional` in the loop); sampled output has the target's distribution with rows
of both kinds in one batch.
"""
import importlib

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


@pytest.fixture(scope="module")
def case():
    """A row whose prompt holds the start of its own classic continuation (lookup drafts it), a
    random row (the assistant drafts most of its rounds), and their classic tokens."""
    t, a = pair()
    rng = seeded_rng()
    head = rng.integers(0, 256, 6).tolist()
    cont = jaxspec.generate(t, [head], max_new_tokens=40, eos_token_ids=[]).tokens[0]
    rows = [head + cont[:30], rng.integers(0, 256, 9).tolist()]
    classic = jaxspec.generate(t, rows, max_new_tokens=BUDGET, eos_token_ids=[]).tokens
    return t, a, rows, classic


def test_greedy_equals_classic_with_both_kinds_of_round(case):
    t, a, rows, classic = case
    drafter = hybrid.Drafter()
    # without the exactness probe (its fallback is test_generate's): K runs as asked or the test fails
    r = jaxspec.generate(t, rows, assistant=a, max_new_tokens=BUDGET, eos_token_ids=[], drafter=drafter,
                         block_size=K, exactness_probe=False)
    assert r.tokens == classic
    s = r.stats
    assert (s.mode, s.drafter, s.block_size, s.fallback) == ("speculative", "hybrid", K, None)
    d = s.draft_stats
    assert d["matched_rounds"] > 0 and d["assisted_rounds"] > 0
    assert d["matched_rounds"] + d["assisted_rounds"] == s.row_rounds


def test_a_round_where_every_row_matched_skips_the_assistant(case):
    """One row that copies its prompt: every round is a lookup round (the host rule says so at each
    round's start), the assistant never drafts, and the loop holds the conditional that skips it."""
    t, a, rows, classic = case
    row, full = rows[0], classic[0]
    p = G.plan(t, [row], G.request_of(max_new_tokens=BUDGET), assistant=a, block_size=K, eos_token_ids=[],
               drafter="hybrid", exactness_probe=False)
    state, pre_s, dec_s = p.gen.run(t, p.params, *p.inputs)
    r = p.result(state, pre_s, dec_s)
    assert r.tokens == [full] and (r.stats.drafter, r.stats.block_size) == ("hybrid", K)
    assert " conditional(" in p.gen.compiled_decode_text(t, p.params, state)
    n, rounds = 1, 0
    while n < BUDGET:  # the host rule round by round (lookup drafts accepted while they equal classic's)
        drafts, found, _ = py_lookup(row + full[:n], K - 1, hybrid.N_MIN, hybrid.Drafter().n_max)
        assert found, f"round at {n}: the rule finds no match, the assistant would draft"
        acc = 0
        while acc < K - 1 and drafts[acc] == full[n + acc]:
            acc += 1
        n += min(acc + 1, BUDGET - n)
        rounds += 1
    assert r.stats.draft_stats["assisted_rounds"] == 0
    assert r.stats.draft_stats["matched_rounds"] == r.stats.row_rounds == rounds


def test_registry_and_errors():
    assert "hybrid" in base.KINDS and base.get("hybrid").DEFAULT == hybrid.Drafter()
    with pytest.raises(ValueError, match="'hybrid' needs an assistant"):
        base.resolve("hybrid", None)
    for kw, match in [(dict(n_min=0), "n_min must be an integer in 1..16"), (dict(n_min=3, n_max=2), "larger")]:
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
