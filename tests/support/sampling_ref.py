"""Shared by the tests (moved from tests/engine/test_sampling.py: no test module imports another)."""
import numpy as np


def np_filter_probs(logits, temperature, top_k=None, top_p=None, min_p=None):
    """Independent reference: float64, per row, explicit loops over the sorted order. min_p (a number,
    or one per row) as HF's warper runs it, last: on the distribution top-k / top-p left, drop what is
    below min_p times its most likely token's probability."""
    logits = np.asarray(logits, np.float64)
    out = np.zeros_like(logits)
    for r in range(logits.shape[0]):
        x = logits[r] / temperature
        keep = np.ones(x.shape, bool)
        if top_k is not None and top_k < x.size:
            kth = np.sort(x)[::-1][top_k - 1]
            keep &= x >= kth
        if top_p is not None and top_p < 1.0:
            xs = np.where(keep, x, -np.inf)
            p = np.exp(xs - xs.max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            mass = 0.0
            chosen = np.zeros(x.shape, bool)
            for i in order:
                if mass >= top_p or p[i] == 0:
                    break
                chosen[i] = True
                mass += p[i]
            thresh = p[chosen].min()
            keep &= p >= thresh
        m = min_p[r] if np.ndim(min_p) else min_p
        if m:
            xs = np.where(keep, x, -np.inf)
            p = np.exp(xs - xs.max())
            p /= p.sum()
            keep &= p >= m * p.max()
        xs = np.where(keep, x, -np.inf)
        p = np.exp(xs - xs.max())
        out[r] = p / p.sum()
    return out


def np_penalised(x, counts, prompt, presence, frequency, repetition):
    """The penalties' definitions (issue 68), float64, one position of one row: HF's repetition penalty
    over the prompt's and the generated tokens (x * r below 0, x / r else), then OpenAI's presence and
    frequency penalties over the generated ones (counts: each token's count so far; prompt: a mask)."""
    x = np.asarray(x, np.float64).copy()
    for t in range(x.size):
        if prompt[t] or counts[t] > 0:
            x[t] = x[t] * repetition if x[t] < 0 else x[t] / repetition
        x[t] -= counts[t] * frequency + (presence if counts[t] > 0 else 0.0)
    return x
