"""The exact first-three-token distribution of a tiny pair, and the test statistic against it: shared by
the lossless-sampling tests of the loop (tests/engine/test_sampling_generate.py) and of the drafters."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from support.pairs import make_pair
from support.sampling_ref import np_filter_probs


V_ = 8          # vocabulary


N = 4000        # sampled sequences (one batch row each)


PROMPT = [3, 1, 4, 1, 5]


SETTING = dict(temperature=0.9, top_k=6, top_p=0.95)


@pytest.fixture(scope="module")
def tiny_pair():
    return make_pair(seed=11, vocab=V_, target_damp=0.3, assistant_damp=0.1)


@pytest.fixture(scope="module")
def exact(tiny_pair):
    """P(x1, x2, x3 | prompt) [V, V, V] from the target's logits on every prefix, filtered with an
    independent numpy implementation of temperature / top-k / top-p."""
    t, _ = tiny_pair
    x1, x2 = np.meshgrid(np.arange(V_), np.arange(V_), indexing="ij")
    ids = np.concatenate([np.tile(PROMPT, (V_ * V_, 1)), x1.reshape(-1, 1), x2.reshape(-1, 1)], 1)
    logits = np.asarray(jax.jit(models.logits)(t, jnp.asarray(ids, jnp.int32)), np.float64)
    n = len(PROMPT)
    f = lambda lg: np_filter_probs(lg, SETTING["temperature"], SETTING["top_k"], SETTING["top_p"])
    p1 = f(logits[:1, n - 1])[0]                           # [V]
    p2 = f(logits[::V_, n]).reshape(V_, V_)                # [x1, x2]
    p3 = f(logits[:, n + 1]).reshape(V_, V_, V_)           # [x1, x2, x3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(joint.sum() - 1) < 1e-9
    return joint.reshape(-1)


def empirical(tokens):
    seqs = np.asarray([r[:3] for r in tokens])
    assert seqs.shape == (N, 3)
    codes = seqs[:, 0] * V_ * V_ + seqs[:, 1] * V_ + seqs[:, 2]
    return np.bincount(codes, minlength=V_ ** 3) / N


def tv_threshold(p, rng, trials=400, quantile=0.999):
    """The TV distance a correct sampler exceeds with probability ~1e-3 at this sample size."""
    draws = rng.multinomial(N, p, size=trials) / N
    tvs = 0.5 * np.abs(draws - p).sum(1)
    return np.quantile(tvs, quantile) * 1.1  # margin for the finite number of trials
