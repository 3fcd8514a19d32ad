"""Presets and random models: real shapes trace end to end (abstractly, no memory), quantized random
init never makes float linear weights, and the assistant reads only committed keys."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from jaxspec.models import layer_scan, presets
from jaxspec.models.params import LINEAR
from jaxspec.kernels import DispatchConfig, QuantizedWeight

Q4 = {"bits": 4, "group_size": 64}


def logical_params(shapes):
    return sum(math.prod(s) for s, _ in shapes.values())


@pytest.mark.parametrize("name,lo,hi", [("12b", 11e9, 13.5e9), ("31b", 29e9, 33e9)])
def test_real_shape_parameter_counts(name, lo, hi):
    n = logical_params(models.target_shapes(presets.target_config(name)))
    assert lo < n < hi, n


def test_12b_pair_traces_quantized_without_float_weights():
    """random_model + prefill/verify forward + draft_step for the real 12B shapes, under eval_shape."""
    tcfg, acfg = presets.target_config("12b"), presets.assistant_config("12b")
    assert tcfg.layer_types.count("full_attention") == 8 and tcfg.layer_kv_heads[5] == 1
    models.check_fit(acfg, tcfg)
    mm = DispatchConfig(backend="xla")
    t = jax.eval_shape(lambda k: presets.random_model(tcfg, k, quantize=Q4, matmul=mm), jax.random.PRNGKey(0))
    a = jax.eval_shape(lambda k: presets.random_model(acfg, k, quantize=Q4, matmul=mm), jax.random.PRNGKey(1))
    shapes = models.target_shapes(tcfg)
    per_layer = jax.eval_shape(functools.partial(layer_scan.unstack_params, tcfg), t.params)  # stored stacked
    for name, (shape, kind) in shapes.items():
        w = per_layer[name]
        if kind == LINEAR:
            assert isinstance(w, QuantizedWeight) and w.weight.dtype == jnp.uint32, name
            assert w.shape == shape and w.scales.dtype == jnp.bfloat16, name
            n, k = shape  # the kernels' layout: 64-row tiles per group, [K/g, N] scales and biases
            assert w.weight.shape == (-(-n // 64), k // 64, 64, 8) and w.scales.shape == (k // 64, n), name
            assert w.biases.shape == w.scales.shape, name
        else:
            assert w.dtype == jnp.bfloat16, name
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(t.params))
    assert 6.0e9 < nbytes < 7.5e9, nbytes  # ~4.5 bits per weight
    cache = jax.eval_shape(lambda: models.init_cache(tcfg, 1, 64, jnp.bfloat16))
    for k in (4, 1):
        lg, h, c = jax.eval_shape(models.forward, t, jax.ShapeDtypeStruct((1, k), jnp.int32), cache)
        assert lg.shape == (1, k, 262_144) and lg.dtype == jnp.float32 and h.shape == (1, k, 3840)
    dl, hn = jax.eval_shape(models.draft_step, a, t, cache, jax.ShapeDtypeStruct((1,), jnp.int32),
                            jax.ShapeDtypeStruct((1, 3840), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32))
    assert dl.shape == (1, 262_144) and hn.shape == (1, 3840)


@pytest.mark.parametrize("name", ["e2b", "e4b", "31b"])
def test_other_presets_fit_and_build(name):
    tcfg, acfg = presets.target_config(name), presets.assistant_config(name)
    models.check_fit(acfg, tcfg)
    a = jax.eval_shape(lambda k: presets.random_model(acfg, k, quantize=Q4), jax.random.PRNGKey(0))
    assert set(a.params) == set(models.assistant_shapes(acfg))


def test_draft_step_reads_only_committed_keys():
    """Keys at positions >= cache.lengths (stale: a rejected verify block before rollback) never change
    a draft step, bitwise; the same keys do change it once they are counted as committed."""
    tdict = presets.tiny_target_dict()
    tcfg = models.TargetConfig.from_dict(tdict)
    acfg = models.AssistantConfig.from_dict(presets.tiny_assistant_dict(tdict, use_ordered_embeddings=True))
    mm = DispatchConfig(backend="xla")
    t = presets.random_model(tcfg, jax.random.PRNGKey(0), dtype=jnp.float32, quantize={"bits": 4, "group_size": 32},
                             matmul=mm)
    a = presets.random_model(acfg, jax.random.PRNGKey(1), dtype=jnp.float32, quantize={"bits": 4, "group_size": 32},
                             matmul=mm)
    lengths = jnp.asarray([9, 6], jnp.int32)
    c = models.init_cache(tcfg, 2, 16, jnp.float32)
    key = jax.random.PRNGKey(2)
    rnd = lambda j, x: jax.random.normal(jax.random.fold_in(key, j), x.shape, x.dtype)
    clean = c.replace(k=tuple(rnd(j, x) for j, x in enumerate(c.k)), v=tuple(rnd(10 + j, x) for j, x in enumerate(c.v)),
                      lengths=lengths)
    stale = jnp.arange(16)[None, :, None, None] >= lengths[:, None, None, None]
    dirty = clean.replace(k=tuple(jnp.where(stale, rnd(20 + j, x), x) for j, x in enumerate(clean.k)),
                          v=tuple(jnp.where(stale, rnd(30 + j, x), x) for j, x in enumerate(clean.v)))
    tok = jnp.asarray([3, 200], jnp.int32)
    h = jax.random.normal(jax.random.PRNGKey(3), (2, tcfg.hidden_size))
    step = jax.jit(models.draft_step)
    l1, h1 = step(a, t, clean, tok, h, lengths)
    l2, h2 = step(a, t, dirty, tok, h, lengths)
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    np.testing.assert_array_equal(np.asarray(h1), np.asarray(h2))
    assert bool(jnp.all(jnp.isfinite(l1)))
    l3, _ = step(a, t, dirty.replace(lengths=lengths + 3), tok, h, lengths)
    assert not np.array_equal(np.asarray(l1), np.asarray(l3))


def test_random_params_are_a_function_of_the_key():
    """The host (numpy) path and the device path each give the same params for the same key and
    different ones for another key."""
    shapes = models.target_shapes(models.TargetConfig.from_dict(presets.tiny_target_dict()))
    q = {"bits": 4, "group_size": 32}
    leaves = lambda p: [np.asarray(x) for x in jax.tree.leaves(p)]
    for key in (jax.random.PRNGKey(5), jax.random.key(5)):
        a, b = presets.random_params(shapes, key, quantize=q), presets.random_params(shapes, key, quantize=q)
        assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b), strict=True))
    c = presets.random_params(shapes, jax.random.PRNGKey(6), quantize=q)
    assert not np.array_equal(np.asarray(a["embed_tokens"].weight), np.asarray(c["embed_tokens"].weight))


def tiny_pair_rollout(t, a, prompt, steps):
    """Greedy target decoding from `prompt [1, P]` for `steps` tokens, and at every decode position
    n the assistant's first draft (token = the target's token at n, h_prev = the target hidden at
    n - 1, cache rolled back to n, position n) next to the target's token at n + 1."""
    fwd, draft = jax.jit(models.forward), jax.jit(models.draft_step)
    cache = models.init_cache(t.config, 1, prompt.shape[1] + steps + 1, t.dtype)
    lg, h, cache = fwd(t, prompt, cache)
    seq, hidden = [int(jnp.argmax(lg[0, -1]))], [h[:, -1]]
    for _ in range(steps):
        lg, h, cache = fwd(t, jnp.asarray([[seq[-1]]], jnp.int32), cache)
        seq.append(int(jnp.argmax(lg[0, -1])))
        hidden.append(h[:, -1])
    p = prompt.shape[1]
    drafts = []
    for j in range(steps):  # seq[j] sits at position p + j; its successor is seq[j + 1]
        n = jnp.asarray([p + j], jnp.int32)
        dl, _ = draft(a, t, cache.replace(lengths=n), jnp.asarray([seq[j]], jnp.int32), hidden[j], n)
        drafts.append(int(jnp.argmax(dl[0])))
    return np.asarray(seq), np.asarray(drafts)


def test_tiny_pair_configs_and_determinism():
    t, a = presets.tiny_pair(seed=3, vocab_size=384, context=128, target_layers=3, matmul=DispatchConfig(backend="xla"))
    tc, ac = t.config, a.config
    assert tc.vocab_size == ac.vocab_size == 384 and tc.num_hidden_layers == 3
    assert tc.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert tc.max_position_embeddings == ac.text.max_position_embeddings == 128 and tc.eos_token_ids == (1,)
    assert ac.text.num_hidden_layers == 1 and ac.text.hidden_size == tc.hidden_size
    models.check_fit(ac, tc)
    t_params = layer_scan.unstack_params(tc, t.params)
    for m in (t, a):
        for name, (shape, kind) in (models.target_shapes(tc) if m is t else models.assistant_shapes(ac)).items():
            w = (t_params if m is t else m.params)[name]
            if name != "pre_projection" and kind == LINEAR:
                assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size) == (4, 32), name
            assert w.shape == shape and w.dtype == jnp.bfloat16, name
    # the shaping: a shared table and final norm, an identity pre_projection, damped blocks
    assert a.params["embed_tokens"] is t.params["embed_tokens"] and a.params["norm"] is t.params["norm"]
    h = tc.hidden_size
    pre = np.asarray(a.params["pre_projection"], np.float32)
    np.testing.assert_array_equal(pre[:, :h], np.eye(h))
    assert 0 < np.abs(pre[:, h:]).max() < 0.1
    assert (np.asarray(t.params["norm"], np.float32) < 0).any()
    assert np.abs(np.asarray(t_params["layers.0.post_attention_layernorm"], np.float32)).max() < 0.3
    leaves = lambda m: [np.asarray(x) for x in jax.tree.leaves(m.params)]
    t2, a2 = presets.tiny_pair(seed=3, vocab_size=384, context=128, target_layers=3)
    for m, m2 in ((t, t2), (a, a2)):
        assert all(np.array_equal(x, y) for x, y in zip(leaves(m), leaves(m2), strict=True))
    t3, _ = presets.tiny_pair(seed=4, vocab_size=384, context=128, target_layers=3)
    assert not np.array_equal(np.asarray(t.params["embed_tokens"].weight), np.asarray(t3.params["embed_tokens"].weight))
    with pytest.raises(ValueError, match="target_layers"):
        presets.tiny_pair(target_layers=0)


def test_tiny_pair_speculates():
    """The reason for the shaping: the target's greedy text is not one repeated token, and the
    assistant's drafts agree with it sometimes, not never and not always."""
    t, a = presets.tiny_pair(seed=0, matmul=DispatchConfig(backend="xla"))
    prompt = jnp.asarray(np.random.default_rng(0).integers(3, 512, size=(1, 5)), jnp.int32)
    seq, drafts = tiny_pair_rollout(t, a, prompt, 32)
    assert len(set(seq.tolist())) >= 4, seq
    agree = float(np.mean(drafts == seq[1:]))
    assert 0.1 <= agree <= 0.95, (agree, seq, drafts)
