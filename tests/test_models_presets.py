"""Presets and random models: real shapes trace end to end (abstractly, no memory), quantized random
init never makes float linear weights, and the assistant reads only committed keys."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import presets
from models.checkpoint import LINEAR
from pallas_kernels import DispatchConfig, QuantizedWeight

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
    for name, (shape, kind) in shapes.items():
        w = t.params[name]
        if kind == LINEAR:
            assert isinstance(w, QuantizedWeight) and w.weight.dtype == jnp.uint32, name
            assert w.shape == shape and w.scales.dtype == jnp.bfloat16, name
            assert w.sb_layout == "kn" and w.scales.shape == (shape[1] // 64, shape[0]), name  # the kernels' layout
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
