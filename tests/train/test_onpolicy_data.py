"""The on-policy data stage's pieces (jaxspec.train.onpolicy_data) on the tiny target: the teacher's
top-k scored on the continuation only against the full forward's logits (float64 log-softmax), the
held-out continuations of prompts of any length against one-prompt generation, and the order of
sampled and greedy batches a time limit can cut."""
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import models
from jaxspec.models import presets
from jaxspec.train import onpolicy_data as od
from support.seeds import seeded_int


def test_teacher_topk_is_the_full_forwards_top_k_at_continuation_positions():
    seed = seeded_int(1 << 20)
    target, _ = presets.tiny_pair(seed, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    p, t, k = 6, 10, 5
    rows = rng.integers(3, target.config.vocab_size, (3, p + t)).astype(np.int32)
    ids, lp = od.teacher_topk(target, rows, p, k, batch=2)  # 3 rows: the last batch is padded
    assert ids.shape == (3, t, k) and lp.shape == (3, t, k) and lp.dtype == np.float16
    cache = models.init_cache(target.config, 3, p + t, jnp.float32, ring=False)
    full = np.asarray(models.forward(target, jnp.asarray(rows), cache)[0], np.float64)[:, p - 1:-1]
    ref = full - full.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    order = np.argsort(-ref, -1, kind="stable")
    srt = np.take_along_axis(ref, order, -1)
    clear = (srt[..., :k] - srt[..., 1:k + 1] > 1e-4).all(-1)  # no near tie inside the top k + 1
    assert clear.mean() > 0.8
    np.testing.assert_array_equal(ids[clear], order[..., :k][clear])
    np.testing.assert_allclose(lp.astype(np.float64), np.take_along_axis(ref, ids, -1), atol=2e-3, rtol=2e-3)


def test_heldout_continuations_keep_short_prompts_and_every_batch():
    """Prompts shorter than the width (the written held-out prompts are 13-20 tokens) are kept,
    right-padded, and the last, partial batch is continued too: each row is that prompt's own
    greedy continuation."""
    seed = seeded_int(1 << 20)
    target, _ = presets.tiny_pair(seed, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    width, new = 8, 6
    prompts = [rng.integers(3, target.config.vocab_size, n).tolist() for n in (8, 3, 8)]
    rows = od.continue_all(target, prompts, new, width, batch=2)
    assert rows.shape == (3, width + new)
    for x, r in zip(prompts, rows):
        alone = jaxspec.generate(target, x, max_new_tokens=new, block_size=1, eos_token_ids=[]).tokens[0]
        assert r[:len(x)].tolist() == x and not r[len(x):width].any()
        assert r[width:].tolist() == alone[:new]


def test_batch_order_keeps_the_sampled_share_in_every_prefix():
    for n_s, n_g in ((32, 32), (1, 2), (5, 12), (0, 3), (3, 0)):
        order = od.batch_order(n_s, n_g)
        assert len(order) == n_s + n_g and sum(order) == n_s
        for i in range(1, len(order) + 1):  # the sampled batches of any prefix: its share, rounded
            assert abs(sum(order[:i]) - i * n_s / (n_s + n_g)) <= 0.5 + 1e-9, (n_s, n_g, i)
