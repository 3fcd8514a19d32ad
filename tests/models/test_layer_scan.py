"""Layers traced once (models.layer_scan, pallas_kernels.Layer): the plan, stacking at load and
unstacking at save, kernels reading a layer of a stack in place (bitwise what the slice gives), the
scanned forward against the per-layer one, and a program whose size does not grow with depth."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from support.gpu_lowering import TRITON_CALL, lower_for_cuda
from jaxspec.models import layer_scan, presets
from jaxspec.models.config import FULL, SLIDING, TargetConfig
from jaxspec.kernels import DispatchConfig, Layer, quantize, quantized_matmul_many
from jaxspec.kernels.decode_attention import decode_attention
from jaxspec.kernels.flash_attention import flash_attention
from jaxspec.kernels.launch import gemv, gemv_tiling
from jaxspec.kernels.stack import take

INTERPRET = DispatchConfig(backend="pallas", interpret=True)


def tiny_cfg(n: int, every: int = 3, **kw) -> TargetConfig:
    d = presets.tiny_target_dict(num_hidden_layers=n, layer_types=presets.layer_pattern(n, every), **kw)
    return TargetConfig.from_dict(d)


# ---- the plan ---------------------------------------------------------------------------------
def test_plan_of_the_presets():
    plan = layer_scan.scan_plan(presets.target_config("12b"))
    assert (plan.period, plan.groups) == (6, 8)  # five sliding + one full, eight times
    e2b = presets.target_config("e2b")  # KV-shared layers and the layers they read stay unrolled
    plan = layer_scan.scan_plan(e2b)
    stores = {e2b.store_layer(t) for t in set(e2b.layer_types)}
    assert plan.scanned <= min(stores) and plan.groups >= 1
    for i in range(plan.scanned):
        assert e2b.layer_types[i] == e2b.layer_types[i % plan.period]


@pytest.mark.parametrize("n,every", [(7, 3), (4, 2), (5, 5), (1, 1)])
def test_cache_entries_cover_every_layer_once(n, every):
    cfg = tiny_cfg(n, every)
    plan = layer_scan.scan_plan(cfg)
    entries = layer_scan.cache_entries(cfg)
    assert sorted(i for layers in entries for i in layers) == list(cfg.cache_layers)
    for i in cfg.cache_layers:
        j, index = layer_scan.cache_entry(cfg, i)
        assert entries[j][0 if index is None else index] == i
        assert (index is None) == (i >= plan.scanned)


def test_stack_unstack_round_trip():
    cfg = tiny_cfg(7, 3)  # period 3, two groups, one layer left over
    params = presets.random_params(models.target_shapes(cfg), jax.random.key(3), dtype=jnp.float32,
                                   quantize={"bits": 4, "group_size": 32})
    stacked = layer_scan.stack_params(cfg, params)
    assert "layers.6.self_attn.q_proj" in stacked and "layers.0.self_attn.q_proj" not in stacked
    assert stacked["scan.1.self_attn.q_proj"].weight.shape[0] == 2
    back = layer_scan.unstack_params(cfg, stacked)
    assert set(back) == set(params)
    for name in params:
        for a, b in zip(jax.tree_util.tree_leaves(params[name]), jax.tree_util.tree_leaves(back[name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- kernels on a layer of a stack ------------------------------------------------------------
def test_stacked_matmul_is_the_layer_bitwise():
    rng = np.random.default_rng(11)
    n, k, layers = 192, 256, 3
    qws = [quantize(jnp.asarray(rng.normal(size=(n, k)), jnp.float32), bits=4, group_size=64) for _ in range(layers)]
    stack = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *qws)
    other = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *qws[::-1])
    for rows in (1, 5, 40):  # qmv, multirow, qmm
        x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
        for cfg in (INTERPRET, DispatchConfig(backend="xla")):
            run = jax.jit(lambda x, i: quantized_matmul_many(x, (Layer(stack, i), Layer(other, i)), config=cfg))
            for i in (0, 2):
                got = run(x, jnp.int32(i))
                want = jax.jit(lambda x, a=qws[i], b=qws[layers - 1 - i]: quantized_matmul_many(x, (a, b), config=cfg))(x)
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("t", [1, 3, 40])
def test_stacked_attention_is_the_layer_bitwise(t):
    rng = np.random.default_rng(t)
    layers, b, c, hkv, hq, d = 3, 2, 64, 2, 4, 16
    ks, vs = (jnp.asarray(rng.normal(size=(layers, b, c, hkv, d)), jnp.float32) for _ in range(2))
    k_pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    q_pos = jnp.broadcast_to(jnp.arange(c - t, c, dtype=jnp.int32), (b, t))
    fn = (functools.partial(decode_attention, window=9, interpret=True) if t <= 16 else
          functools.partial(flash_attention, window=None, block_q=16, block_k=16, interpret=True))
    for i in range(layers):
        got = jax.jit(lambda q, k, v, i: fn(q, k, v, q_pos, k_pos, layer=i))(q, ks, vs, jnp.int32(i))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(q, ks[i], vs[i], q_pos, k_pos)))


def test_stacked_kernels_lower_for_cuda():
    """At the 12B's shapes: a 4-bit q/k/v launch and the decode attention of a stack, both reading
    the layer index from an operand, pass the Triton lowering."""
    n_layers, h, d = 8, 3840, 256
    w = jax.ShapeDtypeStruct((n_layers, 4096 // 64, h // 64, 64, 8), jnp.uint32)
    s = jax.ShapeDtypeStruct((n_layers, h // 64, 4096), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1, h), jnp.bfloat16)
    from jaxspec.kernels import QuantizedWeight

    def qkv(x, w, s, b, i):
        qw = QuantizedWeight(w, s, b, 4, 64)
        return gemv(x, (qw, qw), gemv_tiling((8192, h), 64), interpret=False, layer=Layer(qw, i).operand())
    assert TRITON_CALL in lower_for_cuda(qkv, x, w, s, s, jax.ShapeDtypeStruct((), jnp.int32))
    kv = jax.ShapeDtypeStruct((n_layers, 1, 4096, 8, d), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((1, 4, 16, d), jnp.bfloat16)
    pos = (jax.ShapeDtypeStruct((1, 4), jnp.int32), jax.ShapeDtypeStruct((1, 4096), jnp.int32))
    att = lambda q, k, v, qp, kp, i: decode_attention(q, k, v, qp, kp, 1024, layer=i)  # noqa: E731
    assert TRITON_CALL in lower_for_cuda(att, q, kv, kv, *pos, jax.ShapeDtypeStruct((), jnp.int32))


# ---- the model --------------------------------------------------------------------------------
# The Pallas half (a whole model in interpret mode, ~100 s loaded) is slow tier: the stacked kernels'
# own bitwise tests above cover Pallas under the scan, and the xla half the scan's wiring.
@pytest.mark.parametrize("matmul", [DispatchConfig(backend="xla"),
                                    pytest.param(INTERPRET, marks=pytest.mark.slow)], ids=["xla", "pallas"])
def test_scanned_forward_matches_per_layer(matmul):
    """make_target stacks (the scan); a Target built on per-layer params runs the same layers one by
    one. Prefill, a decode step and a verify agree, and their caches hold the same K/V."""
    cfg = tiny_cfg(7, 3, vocab_size=256)
    params = presets.random_params(models.target_shapes(cfg), jax.random.key(5), dtype=jnp.float32,
                                   quantize={"bits": 4, "group_size": 32})
    scanned = models.make_target(cfg, params, matmul)
    per_layer = models.Target(config=cfg, params=params, matmul=matmul)
    assert layer_scan.is_stacked(scanned.params) and not layer_scan.is_stacked(per_layer.params)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, 12)), jnp.int32)
    fwd = jax.jit(models.forward)
    outs = []
    for t in (scanned, per_layer):
        cache = models.init_cache(cfg, 2, 32, jnp.float32)
        lp, _, cache = fwd(t, ids[:, :8], cache)
        ld, _, cache = fwd(t, ids[:, 8:9], cache)
        lv, _, cache = fwd(t, ids[:, 9:12], cache)
        outs.append((lp, ld, lv, cache))
    for a, b in zip(outs[0][:3], outs[1][:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    for a, b in zip(outs[0][3].k + outs[0][3].v, outs[1][3].k + outs[1][3].v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def _program_size(n_layers: int) -> int:
    cfg = tiny_cfg(n_layers, 3, vocab_size=256)
    t = presets.random_model(cfg, jax.random.key(0), dtype=jnp.float32, matmul=DispatchConfig(backend="xla"))
    cache = models.init_cache(cfg, 1, 16, jnp.float32)
    jaxpr = jax.make_jaxpr(models.forward)(t, jnp.zeros((1, 1), jnp.int32) + 1, cache)
    return sum(1 for _ in _equations(jaxpr.jaxpr))


def _equations(jaxpr):
    """Every equation, those of nested jaxprs (scan and cond bodies, pallas kernels) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_traced_program_does_not_grow_with_depth():
    """The forward traced at 6, 12 and 24 layers (period 3): the same number of equations, so tracing,
    lowering and compiling cost the same (the CPU compile times are in the cold-start results)."""
    sizes = [_program_size(n) for n in (6, 12, 24)]
    assert sizes[0] == sizes[1] == sizes[2], sizes
    assert _program_size(7) > sizes[0]  # the leftover layer is traced on its own


def test_shared_kv_reads_the_stacks():
    cfg = tiny_cfg(6, 3, vocab_size=256)
    t = presets.random_model(cfg, jax.random.key(1), dtype=jnp.float32, matmul=DispatchConfig(backend="xla"))
    cache = models.init_cache(cfg, 1, 16, jnp.float32)
    _, _, cache = jax.jit(models.forward)(t, jnp.asarray([[3, 4, 5, 6]], jnp.int32), cache)
    kv = models.shared_kv(cfg, cache)
    for kind in (SLIDING, FULL):
        i = cfg.store_layer(kind)
        j, index = layer_scan.cache_entry(cfg, i)
        k = take(kv[kind][0])
        np.testing.assert_array_equal(np.asarray(k), np.asarray(cache.k[j][index]))
        assert float(jnp.abs(k[:, :4]).sum()) > 0  # the prompt's keys are there
