"""A trimmed draft vocabulary (`models.with_draft_vocab`): the head scores only N token ids, a token
outside them is never drafted, and the loop's output stays the target's. References: classic
decoding (the output), the untrimmed head's logits restricted to the ids by numpy (the drafts and
the id mapping), the saved-and-loaded drafter (the ids and rebuilt head)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import models
from jaxspec.drafters import mtp
from jaxspec.models import presets
from support.seeds import seeded_int


@pytest.fixture(scope="module")
def pair():
    seed = seeded_int(1 << 20)
    target, assistant = presets.tiny_pair(seed, dtype=jnp.float32)
    rng = np.random.default_rng(seed)
    v = target.config.vocab_size
    prompts = [rng.integers(3, v, int(n)).tolist() for n in rng.integers(4, 12, 4)]
    classic = jaxspec.generate(target, prompts, max_new_tokens=32, block_size=1, eos_token_ids=[])
    # two thirds of the tokens the target writes for these prompts (the most frequent) plus random
    # others: the head keeps many of the target's tokens and misses some, so drafts are kept and refused
    counts = np.bincount(np.concatenate([np.asarray(t) for t in classic.tokens]), minlength=v)
    written = np.argsort(-counts, kind="stable")[:max(1, 2 * int((counts > 0).sum()) // 3)]
    rest = rng.permutation(np.setdiff1d(np.arange(v), np.flatnonzero(counts)))[:16]
    ids = rng.permutation(np.concatenate([written, rest]))  # the head's order is not the ids' order
    return target, assistant, models.with_draft_vocab(assistant, ids), ids, rng, prompts, classic


def test_trimmed_head_never_changes_the_output(pair):
    target, _, trimmed, ids, rng, prompts, classic = pair
    spec = jaxspec.generate(target, prompts, assistant=trimmed, max_new_tokens=32, block_size=4, eos_token_ids=[])
    assert spec.tokens == classic.tokens
    st = spec.stats
    assert st.mode != "classic" and st.block_size == 4, (st.mode, st.block_size)
    # not vacuous: drafts were kept and refused, and the target wrote tokens the head cannot draft
    assert 0 < st.accepted < st.drafted, (st.accepted, st.drafted)
    out = np.concatenate([np.asarray(t) for t in classic.tokens])
    assert not np.isin(out, ids).all()
    # the path through the [B, V] logits (a logit bias makes the loop use draft_step + draft_choice)
    biased = jaxspec.generate(target, prompts, assistant=trimmed, max_new_tokens=32, block_size=4, eos_token_ids=[],
                              logit_bias={int(ids[0]): 0.0})
    assert biased.tokens == classic.tokens and biased.stats.mode != "classic"
    assert biased.stats.accepted == st.accepted  # the same drafts, through the [B, V] logits


def test_drafts_are_the_restricted_argmax_mapped_back(pair):
    target, full, trimmed, ids, rng = pair[:5]
    tcfg = target.config
    b, s = 3, 20
    toks = jnp.asarray(rng.integers(3, tcfg.vocab_size, (b, s)), jnp.int32)
    cache = models.init_cache(tcfg, b, s, jnp.float32, ring=False)
    _, hidden, cache = jax.jit(models.forward)(target, toks, cache)
    # shared_kv inside the jit: its Layer views are static structure, not arguments
    chain = jax.jit(lambda a, c, x, hh, n: mtp.draft_chain(a, target, models.shared_kv(tcfg, c), x, hh, n, n, 3))
    step = jax.jit(lambda a, c, x, hh, n: models.draft_logits(a, target, models.shared_kv(tcfg, c), x, hh, n, n))
    q = s - 1
    lengths = jnp.broadcast_to(jnp.arange(1, q + 1, dtype=jnp.int32), (b, q))
    token, h = toks[:, 1:], hidden[:, :q]
    drafts, logits = chain(trimmed, cache, token, h, lengths)
    assert logits[0].shape == (b, q, len(ids))
    assert np.isin(np.asarray(drafts), ids).all()
    # step by step against the full head restricted to the ids (float64 numpy argmax)
    for j in range(3):
        ref_logits, h_next = step(full, cache, token, h, lengths)
        ref = np.asarray(ref_logits, np.float64)[..., ids]
        np.testing.assert_allclose(np.asarray(logits[j]), ref, rtol=1e-5, atol=1e-5)
        top2 = np.sort(ref, axis=-1)[..., -2:]
        clear = top2[..., 1] - top2[..., 0] > 1e-4  # a near tie may round either way
        assert clear.mean() > 0.9
        want = ids[np.argmax(ref, axis=-1)]
        np.testing.assert_array_equal(np.asarray(drafts[..., j])[clear], want[clear])
        token, h = drafts[..., j], h_next
    # draft_step's [B, V] logits: the head's values at the ids, -inf elsewhere
    c1 = cache.replace(lengths=jnp.full((b,), 5, jnp.int32))
    lg, _ = jax.jit(models.draft_step)(trimmed, target, c1, toks[:, 5], hidden[:, 4], jnp.full((b,), 5, jnp.int32))
    lg = np.asarray(lg)
    outside = np.setdiff1d(np.arange(tcfg.vocab_size), ids)
    assert np.isneginf(lg[:, outside]).all() and np.isfinite(lg[:, ids]).all()


def test_saved_trimmed_drafter_round_trips(pair, tmp_path):
    target, _, trimmed, ids = pair[:4]
    models.save(trimmed, str(tmp_path))
    back = models.load_assistant(str(tmp_path), dtype=jnp.float32, target=target)
    assert back.config.draft_vocab_size == len(ids)
    np.testing.assert_array_equal(np.asarray(back.params["draft_vocab"]), ids)
    np.testing.assert_allclose(np.asarray(back.params["draft_head"]), np.asarray(trimmed.params["draft_head"]))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert "draft_vocab" in f.keys() and not any("draft_head" in k for k in f.keys())


def test_bad_vocabularies_are_refused(pair):
    full = pair[1]
    v = full.config.vocab_size
    for bad, why in (([], "non-empty"), ([1, 1], "distinct"), ([v], "in \\[0"), (np.zeros((2, 2), int), "1-D")):
        with pytest.raises(ValueError, match=why):
            models.with_draft_vocab(full, np.asarray(bad, np.int64))
    with pytest.raises(ValueError, match="draft_vocab_size=.* > vocab_size"):
        models.AssistantConfig(**{**full.config.__dict__, "draft_vocab_size": v + 1})
    jax.clear_caches()
