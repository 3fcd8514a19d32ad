"""Presence / frequency / repetition penalties (issue 68) against their definitions: a float64 numpy
implementation of OpenAI's formula and HF's repetition penalty, per row, per verify position (the
counts of a speculative block's position j include the drafts before it), and transformers'
RepetitionPenaltyLogitsProcessor on the same logits; the request's ranges and capability."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import penalties, sampling
from support.sampling_ref import np_penalised
from support.seeds import seeded_rng

V = 40


def _rows(rng, b):
    """Per-row settings: each penalty alone, all together, and none (neutral), then random ones."""
    fixed = [(0.0, 0.0, 1.0), (1.5, 0.0, 1.0), (0.0, -0.7, 1.0), (0.0, 0.0, 1.8), (-1.2, 0.9, 0.6)]
    rand = [(rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(0.3, 3.0)) for _ in range(b - len(fixed))]
    return np.asarray(fixed + rand, np.float32)


def _counts(rng, b):
    generated = rng.integers(0, 4, (b, V)) * (rng.random((b, V)) < 0.3)
    prompt = rng.random((b, V)) < 0.3
    return generated.astype(np.int32), prompt


@jax.jit
def _apply(logits, generated, prompt, pen, drafts):
    counts = penalties.Counts(generated=generated, prompt=prompt)
    return penalties.apply(logits, counts, pen[:, 0], pen[:, 1], pen[:, 2], drafts)


@pytest.mark.parametrize("k", [1, 4])
def test_penalties_match_their_definitions_at_every_verify_position(k):
    """logits [B, K, V] of a verify block: position j is penalised with the row's counts plus the
    drafts d_0 .. d_{j-1} (drawn from a few tokens, so they repeat and meet counted ones), in float64
    by the definition; a neutral row is left bit for bit."""
    rng = seeded_rng()
    b = 8
    logits = rng.normal(0, 3, (b, k, V)).astype(np.float32)
    generated, prompt = _counts(rng, b)
    pen = _rows(rng, b)
    drafts = rng.choice(rng.integers(0, V, 3), (b, k - 1)).astype(np.int32)
    got = np.asarray(_apply(logits, generated, prompt, pen, drafts))
    naive_diff = 0
    for r in range(b):
        for j in range(k):
            c = generated[r].copy()
            for d in drafts[r, :j]:
                c[d] += 1
            want = np_penalised(logits[r, j], c, prompt[r], *pen[r].astype(np.float64))
            np.testing.assert_allclose(got[r, j], want, rtol=2e-6, atol=2e-6, err_msg=f"row {r} position {j}")
            naive = np_penalised(logits[r, j], generated[r], prompt[r], *pen[r].astype(np.float64))
            naive_diff += int(np.any(np.abs(naive - want) > 1e-3))
    assert np.array_equal(got[0], logits[0])  # the neutral row
    if k > 1:
        assert naive_diff > 0  # the drafts' counts changed something: the per-position rule was exercised
    one = np.asarray(_apply(logits[:, 0], generated, prompt, pen, None))  # [B, V]: one position per row
    np.testing.assert_array_equal(one, got[:, 0])


def test_repetition_penalty_matches_transformers():
    """HF's RepetitionPenaltyLogitsProcessor on the same float32 logits, each row with its own
    penalty and token ids (a prompt and generated tokens); presence = frequency = 0. The processor
    takes one penalty, so it runs row by row."""
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = seeded_rng()
    b, n_prompt, n_gen = 6, 9, 7
    logits = rng.normal(0, 3, (b, V)).astype(np.float32)
    ids = rng.integers(0, V, (b, n_prompt + n_gen))
    rep = np.concatenate([[1.0], rng.uniform(0.2, 4.0, b - 1)]).astype(np.float32)
    generated = np.zeros((b, V), np.int32)
    prompt = np.zeros((b, V), bool)
    for r in range(b):
        prompt[r, ids[r, :n_prompt]] = True
        np.add.at(generated[r], ids[r, n_prompt:], 1)
    pen = np.stack([np.zeros(b), np.zeros(b), rep], 1).astype(np.float32)
    got = np.asarray(_apply(logits, generated, prompt, pen, None))
    for r in range(b):
        proc = RepetitionPenaltyLogitsProcessor(penalty=float(rep[r]))
        want = proc(torch.tensor(ids[r:r + 1]), torch.tensor(logits[r:r + 1])).numpy()[0]
        np.testing.assert_allclose(got[r], want, rtol=2.5e-7, atol=0, err_msg=f"row {r}, penalty {rep[r]}")  # x * (1 / r): within 2 ulp
    assert not np.allclose(got[1:], logits[1:])  # the penalty did something


def test_counts_of_the_prompt_and_what_is_recorded():
    """`of_prompt` marks each row's prompt tokens up to its length (not its padding); `record` adds
    the taken tokens, repeats included."""
    rng = seeded_rng()
    prompt = rng.integers(0, V, (3, 6)).astype(np.int32)
    lengths = np.asarray([6, 2, 4], np.int32)
    c = penalties.of_prompt(jnp.asarray(prompt), jnp.asarray(lengths), V)
    for r in range(3):
        assert set(np.flatnonzero(np.asarray(c.prompt[r]))) == set(prompt[r, :lengths[r]].tolist())
    assert not np.asarray(c.generated).any()
    tokens = rng.integers(0, 4, (3, 5)).astype(np.int32)
    take = rng.random((3, 5)) < 0.6
    got = np.asarray(penalties.record(c, jnp.asarray(tokens), jnp.asarray(take)).generated)
    want = np.zeros((3, V), np.int32)
    for r in range(3):
        np.add.at(want[r], tokens[r][take[r]], 1)
    np.testing.assert_array_equal(got, want)


def test_the_request_fields_their_ranges_and_the_capability():
    p = sampling.SamplingParams(presence_penalty=0.5, frequency_penalty=-2, repetition_penalty=1.3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -2.0, 1.3)
    assert p.mode().penalties and p.penalised and p.per_row() == p
    off = sampling.SamplingParams(presence_penalty=None, frequency_penalty=0, repetition_penalty=None)
    assert not off.mode().penalties and (off.presence_penalty, off.repetition_penalty) == (0.0, 1.0)
    assert not sampling.SamplingParams(temperature=1.0, top_p=0.9).mode().covers(p)
    assert sampling.FULL_MODE.covers(p) and not sampling.SamplingMode(sample=True, bias=True).covers(p)
    for name, bad in [("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0),
                      ("repetition_penalty", 0.005), ("repetition_penalty", 101), ("presence_penalty", float("nan")),
                      ("frequency_penalty", "1"), ("repetition_penalty", True)]:
        with pytest.raises(ValueError, match=f"^{name} must be None or a number in"):
            sampling.SamplingParams(**{name: bad})
    rows = sampling.row_params([p, off], sampling.FULL_MODE)
    np.testing.assert_array_equal(np.asarray(rows.repetition), np.float32([1.3, 1.0]))
    with pytest.raises(ValueError, match="needs a program with"):
        sampling.row_params([p], sampling.SamplingMode(sample=True, bias=True))
