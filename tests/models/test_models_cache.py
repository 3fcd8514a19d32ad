"""The static KV cache: prefill + decode == full sequence, rollback, ragged rows, padded verify, and row
invariance (a [B, K] verify is bitwise equal to K [B, 1] decode steps)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from jaxspec.models import presets
from jaxspec.models.config import FULL, SLIDING
from jaxspec.kernels import DispatchConfig

XLA = DispatchConfig(backend="xla")
S, F = SLIDING, FULL
# window 3 (shorter than the sequences), K=V, per-layer inputs, KV sharing + double-wide MLP, softcap.
# Every test uses batch 2, capacity 16 and T in {1, 4, 8, 12} so the jitted forward compiles few shapes.
CFG = models.TargetConfig.from_dict(presets.tiny_target_dict(
    num_hidden_layers=4, layer_types=[S, F, S, F], attention_k_eq_v=True, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256, num_kv_shared_layers=1, use_double_wide_mlp=True, sliding_window=3))
CFG3 = models.TargetConfig.from_dict(presets.tiny_target_dict(
    num_hidden_layers=3, layer_types=[S, F, F], attention_k_eq_v=True, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256, num_kv_shared_layers=1, use_double_wide_mlp=True, sliding_window=3))
CAP = 16
fwd = jax.jit(models.forward)


@functools.lru_cache(maxsize=None)
def target(dtype=jnp.float32, quantize=None, matmul=XLA, cfg=CFG):
    q = None if quantize is None else dict(quantize)
    return presets.random_model(cfg, jax.random.PRNGKey(7), dtype=dtype, quantize=q, matmul=matmul)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def rand_ids(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, size=shape), jnp.int32)


def fresh(dtype=jnp.float32, cfg=CFG, batch=2, cap=CAP):
    return models.init_cache(cfg, batch, cap, dtype)


def reference(t, ids):
    """Full-sequence logits [2, 12] from an empty cache (the path the HF parity test checks)."""
    return fwd(t, ids, fresh())[0]


def test_prefill_then_decode_matches_full_sequence():
    t, ids = target(), rand_ids(1, (2, 12))
    ref = reference(t, ids)
    lg, _, cache = fwd(t, ids[:, :8], fresh())
    outs = [lg]
    for j in range(8, 12):
        lg, _, cache = fwd(t, ids[:, j:j + 1], cache)
        outs.append(lg)
    assert np.array_equal(np.asarray(cache.lengths), [12, 12])
    assert rel_err(jnp.concatenate(outs, 1), ref) < 1e-5


def test_rollback_then_redecode():
    t, ids, junk = target(), rand_ids(2, (2, 12)), rand_ids(3, (2, 4))
    ref = reference(t, ids)
    _, _, cache = fwd(t, ids[:, :8], fresh())
    lg_junk, _, after = fwd(t, junk, cache)  # a rejected verify block
    assert rel_err(lg_junk[:, 0], ref[:, 8]) > 1e-3  # the junk really differs from the real continuation
    cache = after.replace(lengths=after.lengths - 4)
    outs = []
    for j in range(8, 12):
        lg, _, cache = fwd(t, ids[:, j:j + 1], cache)
        outs.append(lg)
    assert rel_err(jnp.concatenate(outs, 1), ref[:, 8:]) < 1e-5


def test_ragged_prefill_and_per_row_lengths():
    """Right-padded prompts of true lengths 4 and 2 (junk in the padding, hidden by `valid`), lengths
    set to the true lengths, then four decode steps: each row matches its own unpadded sequence."""
    t = target()
    lens = np.array([4, 2])
    seqs = rand_ids(4, (2, 12))  # row r: prompt seqs[r, :lens[r]], continuation seqs[r, lens[r]:lens[r]+4]
    ref = reference(t, seqs)  # causal: positions < lens[r] + 4 do not see the tail
    junk = rand_ids(5, (2, 4))
    valid = jnp.arange(4)[None, :] < jnp.asarray(lens)[:, None]
    lg_p, _, cache = fwd(t, jnp.where(valid, seqs[:, :4], junk), fresh(), valid=valid)
    cache = cache.replace(lengths=jnp.asarray(lens, jnp.int32))
    dec = []
    for j in range(4):
        tok = jnp.take_along_axis(seqs, jnp.asarray(lens)[:, None] + j, axis=1)
        lg, _, cache = fwd(t, tok, cache)
        dec.append(lg[:, 0])
    for r, n in enumerate(lens):
        assert rel_err(lg_p[r, :n], ref[r, :n]) < 1e-5
        assert rel_err(jnp.stack([d[r] for d in dec]), ref[r, n:n + 4]) < 1e-5


def test_padded_verify_hides_padding():
    """Verify [2, 4] whose last two positions are padding (valid False, junk tokens): the real
    positions match two decode steps, and so does a decode after rolling the padding back."""
    t, ids, junk = target(), rand_ids(6, (2, 11)), rand_ids(7, (2, 2))
    _, _, cache = fwd(t, ids[:, :8], fresh())
    ref0, _, c = fwd(t, ids[:, 8:9], cache)
    ref1, _, c = fwd(t, ids[:, 9:10], c)
    ref2, _, _ = fwd(t, ids[:, 10:11], c)
    valid = jnp.broadcast_to(jnp.arange(4)[None, :] < 2, (2, 4))
    padded, _, pc = fwd(t, jnp.concatenate([ids[:, 8:10], junk], 1), cache, valid=valid)
    assert rel_err(padded[:, :2], jnp.concatenate([ref0, ref1], 1)) < 1e-5
    after, _, _ = fwd(t, ids[:, 10:11], pc.replace(lengths=pc.lengths - 2))
    assert rel_err(after, ref2) < 1e-5


def random_cache(cfg, dtype, lengths, seed, cap=CAP):
    """A cache full of random K/V (any content will do for a row-invariance check)."""
    c = models.init_cache(cfg, len(lengths), cap, dtype)
    key = jax.random.PRNGKey(seed)
    ks = tuple(jax.random.normal(jax.random.fold_in(key, j), a.shape).astype(dtype) for j, a in enumerate(c.k))
    vs = tuple(jax.random.normal(jax.random.fold_in(key, 100 + j), a.shape).astype(dtype) for j, a in enumerate(c.v))
    return c.replace(k=ks, v=vs, lengths=jnp.asarray(lengths, jnp.int32))


def assert_verify_equals_decode_steps(t, cache, block):
    v_logits, v_hidden, v_cache = fwd(t, block, cache)
    d_logits, d_hidden = [], []
    c = cache
    for j in range(block.shape[1]):
        lg, h, c = fwd(t, block[:, j:j + 1], c)
        d_logits.append(lg)
        d_hidden.append(h)
    np.testing.assert_array_equal(np.asarray(v_logits), np.asarray(jnp.concatenate(d_logits, 1)))
    np.testing.assert_array_equal(np.asarray(v_hidden.astype(jnp.float32)),
                                  np.asarray(jnp.concatenate(d_hidden, 1).astype(jnp.float32)))
    assert np.array_equal(np.asarray(v_cache.lengths), np.asarray(c.lengths))
    # Valid entries (below each row's length) are identical; past it, the padding of a bucketed
    # forward leaves junk that no query can see.
    for a, b in zip(v_cache.k + v_cache.v, c.k + c.v):
        for r, n in enumerate(np.asarray(c.lengths)):
            np.testing.assert_array_equal(np.asarray(a[..., r, :n, :, :].astype(jnp.float32)),
                                          np.asarray(b[..., r, :n, :, :].astype(jnp.float32)))


@pytest.mark.parametrize("dtype,quantize", [(jnp.float32, None),
                                            (jnp.bfloat16, (("bits", 4), ("group_size", 32)))],
                         ids=["f32", "bf16-q4"])
def test_verify_rows_bitwise_equal_decode_steps(dtype, quantize):
    """The precondition of greedy parity: logits, hidden and cache of one [B, K] verify are bitwise
    equal to those of K successive [B, 1] decode steps, with rows at different cache lengths.
    (bf16 compiles slowly on CPU: it runs a 3-layer cut of the same features.)"""
    cfg = CFG if dtype == jnp.float32 else CFG3
    t = target(dtype, quantize, XLA, cfg)
    assert_verify_equals_decode_steps(t, random_cache(cfg, dtype, [7, 5], seed=8), rand_ids(9, (2, 4)))


def test_row_invariance_on_pallas_backend():
    """The same bitwise check through the default kernels (Pallas, interpret mode on CPU), 4-bit."""
    cfg = models.TargetConfig.from_dict(presets.tiny_target_dict(num_hidden_layers=1, layer_types=[F]))
    t = target(jnp.bfloat16, (("bits", 4), ("group_size", 32)), DispatchConfig(), cfg)
    assert_verify_equals_decode_steps(t, random_cache(cfg, jnp.bfloat16, [3], seed=10, cap=8),
                                      rand_ids(11, (1, 2)))


def test_logits_at_picks_one_position_per_row():
    """forward(..., logits_at=idx) returns the full logits at idx (for long and bucketed blocks; the
    head runs on fewer rows, so equal up to rounding) and leaves hidden and cache alone: prefill
    needs one position, not [B, T, V]."""
    t, ids = target(), rand_ids(11, (2, 10))
    for width in (10, 3):
        full, h, c = fwd(t, ids[:, :width], fresh())
        at = jnp.asarray([width - 1, width - 2], jnp.int32)
        part, h2, c2 = fwd(t, ids[:, :width], fresh(), logits_at=at)
        assert part.shape == (2, 1, full.shape[-1])
        assert rel_err(part[:, 0], full[jnp.arange(2), at]) < 1e-5
        np.testing.assert_array_equal(np.asarray(h2), np.asarray(h))
        assert np.array_equal(np.asarray(c2.lengths), np.asarray(c.lengths))
