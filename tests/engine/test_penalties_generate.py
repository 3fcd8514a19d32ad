"""Penalties in the decode loop (issue 68): greedy classic decoding with per-row penalties follows their
float64 definition on the target's own logits; speculative decoding equals it byte for byte at every
K in 2..8 (prompt lookup drafts: one program per K, the cheapest to compile; which drafter proposes
does not matter to the verify's counts); sampled speculative decoding with the MTP assistant's
sampled drafts follows the penalised target distribution (exact enumeration of the first three
tokens on a tiny vocabulary)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
from jaxspec.engine import sampling
from support.distribution import V_, N, PROMPT, tiny_pair, tv_threshold  # noqa: F401
from support.pairs import pair
from support.sampling_ref import np_filter_probs, np_penalised
from support.seeds import seeded_rng

BUDGET = 32
MODE = sampling.SamplingMode(bias=True, penalties=True)  # greedy rows: no distribution computed


def _settings(rng):
    """One request per row: every control at once (top-k / top-p / min-p are ignored at T = 0, the
    bias is on tokens the prompt holds: it comes before the repetition penalty), each penalty on its
    own or against repetition, and none (a neutral row in a penalised program)."""
    return [sampling.SamplingParams(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4,
                                    logit_bias={int(rng.integers(0, 4)): 3.0, int(rng.integers(4, 8)): -2.0},
                                    top_k=5, top_p=0.9, min_p=0.1),
            sampling.SamplingParams(frequency_penalty=float(rng.uniform(0.5, 2.0))),
            sampling.SamplingParams(presence_penalty=-0.8, repetition_penalty=0.7),
            sampling.SamplingParams()]


@pytest.fixture(scope="module")
def greedy_case():
    rng = seeded_rng()
    prompts = [rng.integers(0, 8, n).tolist() for n in (7, 12, 3, 9)]  # few distinct ids: the prompt repeats
    return prompts, _settings(rng)


def _run(k, prompts, settings):
    t, _ = pair()
    gen = jaxspec.make_generate(block_size=k, max_new_tokens=BUDGET, mode=MODE, drafter="ngram" if k > 1 else None)
    state, _, _ = gen.run(t, None, *gen.inputs(prompts, eos_token_ids=(), params=settings))
    return gen.tokens(state), jax.device_get(state)


@pytest.fixture(scope="module")
def classic(greedy_case):
    return _run(1, *greedy_case)[0]


def test_greedy_penalties_follow_their_definition(greedy_case, classic):
    """Classic decoding's every token is the argmax of the target's logits (one teacher-forced forward
    over prompt + output) with the row's bias added and its penalties applied in float64 by their
    definition over what came before it; near-ties (the forward's rounding can flip them) are skipped."""
    t, _ = pair()
    prompts, settings = greedy_case
    vocab = t.config.vocab_size
    seqs = [prompt + out[:-1] for prompt, out in zip(prompts, classic)]
    width = max(map(len, seqs))  # right-padded: a causal forward's earlier positions do not see the pad
    logits = np.asarray(jax.jit(models.logits)(t, jnp.asarray([s + [0] * (width - len(s)) for s in seqs], jnp.int32)),
                        np.float64)
    checked = 0
    for prompt, out, p, lg in zip(prompts, classic, settings, logits):
        assert len(out) == BUDGET
        bias = np.zeros(vocab)
        for tok, v in p.logit_bias:
            bias[tok] += v
        in_prompt = np.zeros(vocab, bool)
        in_prompt[prompt] = True
        for i, tok in enumerate(out):
            counts = np.bincount(out[:i], minlength=vocab)
            x = np_penalised(lg[len(prompt) - 1 + i] + bias, counts, in_prompt, p.presence_penalty,
                             p.frequency_penalty, p.repetition_penalty)
            top2 = np.sort(x)[-2:]
            if top2[1] - top2[0] > 1e-4:
                assert tok == int(np.argmax(x)), (p, i)
                checked += 1
    assert checked > 0.9 * len(prompts) * BUDGET
    assert len(set(classic[1])) > BUDGET // 2  # a frequency penalty >= 0.5: the row keeps moving
    assert len(set(classic[2])) < len(set(classic[1]))  # a negative presence penalty: it repeats


@pytest.mark.parametrize("k", [k if k in (2, 4, 8) else pytest.param(k, marks=pytest.mark.slow)  # CI: 2, 4, 8
                               for k in range(2, 9)])
def test_greedy_speculative_equals_classic_with_penalties(greedy_case, classic, k):
    """Byte for byte, per row, at K = k (the K that ran: its histogram and drafts per round)."""
    tokens, state = _run(k, *greedy_case)
    assert tokens == classic
    assert state.hist.shape == (k,) and np.all(state.drafted == (k - 1) * state.row_rounds)
    assert state.hist[0] > 0 and state.hist[1:].sum() > 0  # drafts both rejected and accepted


SETTING = dict(temperature=0.9, top_k=6, top_p=0.95, presence_penalty=0.7, frequency_penalty=0.5,
               repetition_penalty=1.6, logit_bias={2: 1.5})


def _joint(t, setting):
    """P(x1, x2, x3 | PROMPT) [V^3] under `setting`, float64: each position's logits (the target's,
    on every prefix) biased, penalised by the definition for what precedes it, filtered."""
    x1, x2 = np.meshgrid(np.arange(V_), np.arange(V_), indexing="ij")
    ids = np.concatenate([np.tile(PROMPT, (V_ * V_, 1)), x1.reshape(-1, 1), x2.reshape(-1, 1)], 1)
    lg = np.asarray(jax.jit(models.logits)(t, jnp.asarray(ids, jnp.int32)), np.float64)
    bias = np.zeros(V_)
    for tok, v in setting.get("logit_bias", {}).items():
        bias[tok] = v
    in_prompt = np.isin(np.arange(V_), PROMPT)
    n = len(PROMPT)

    def probs(logits, before):
        x = np_penalised(logits + bias, np.bincount(before, minlength=V_), in_prompt,
                         setting.get("presence_penalty", 0.0), setting.get("frequency_penalty", 0.0),
                         setting.get("repetition_penalty", 1.0))
        return np_filter_probs(x[None], setting["temperature"], setting["top_k"], setting["top_p"])[0]

    joint = np.zeros((V_, V_, V_))
    for a in range(V_):
        pa = probs(lg[a * V_, n - 1], [])[a]
        for b in range(V_):
            joint[a, b] = pa * probs(lg[a * V_ + b, n], [a])[b] * probs(lg[a * V_ + b, n + 1], [a, b])
    assert abs(joint.sum() - 1) < 1e-9
    return joint.reshape(-1)


def test_sampled_speculative_follows_the_penalised_target(tiny_pair):
    """K = 3, sampled drafts (the drafter knows nothing of the penalties): the first three tokens of N
    rows follow the penalised, filtered target distribution (TV against the exact joint); the same
    statistic tells that distribution from the unpenalised one."""
    t, a = tiny_pair
    exact = _joint(t, SETTING)
    plain = _joint(t, dict(SETTING, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0))
    r = jaxspec.generate(t, [PROMPT] * N, assistant=a, max_new_tokens=3, block_size=3,
                         seed=int(seeded_rng().integers(1 << 31)), eos_token_ids=[], **SETTING)
    assert r.stats.mode == "speculative" and r.stats.block_size == 3
    assert r.stats.accepted_hist[0] > 0 and r.stats.accepted_hist[-1] > 0  # rejections and full blocks
    seqs = np.asarray([row[:3] for row in r.tokens])
    emp = np.bincount(seqs[:, 0] * V_ * V_ + seqs[:, 1] * V_ + seqs[:, 2], minlength=V_ ** 3) / N
    assert np.all(emp[exact == 0] == 0), "a sequence of probability 0 was generated"
    thr = tv_threshold(exact, seeded_rng())
    tv = 0.5 * np.abs(emp - exact).sum()
    print(f"penalties: TV {tv:.4f} (threshold {thr:.4f}), against the unpenalised target "
          f"{0.5 * np.abs(plain - exact).sum():.4f}, acceptance {r.stats.acceptance_rate:.2f}")
    assert tv < thr
    assert 0.5 * np.abs(plain - exact).sum() > 3 * thr  # the test can fail: penalties move the distribution
