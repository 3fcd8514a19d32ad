"""Gemma 3 without transformers (so it also runs on the GPU machine, whose transformers is older): the
Pallas path against the XLA path (interpret mode on a CPU, the real kernels on a GPU), the 270M preset's
shapes, its batch-1 row bucket on a CPU, and the config fields the family refuses."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from jaxspec.kernels import DispatchConfig
from jaxspec.models import presets
from jaxspec.models.params import quantize_params
from support.gemma3_configs import CAPACITY, CONFIGS, PREFILL, TOL, XLA, F, rel_err
from support.seeds import seeded_rng


@pytest.mark.slow
def test_kernels_match_xla_path():
    """The Pallas path (interpret mode on the CPU): prefill on flash_attention, decode steps on the
    fused q/k/v kernel (`attention_inputs`, norm_v=False: Gemma 3's raw v) and decode_attention,
    4-bit weights; logits and the cache's K/V as the XLA path gives them."""
    cfg = models.TargetConfig.from_dict(dict(CONFIGS["base"], model_type="gemma3_text"))
    shapes = models.target_shapes(cfg)
    params = presets.random_params(shapes, jax.random.key(seeded_rng().integers(1 << 30)), dtype=jnp.float32,
                                   quantize=None)
    # v's RMS far from 1, so a v norm where Gemma 3 has none shows (random v_proj gives RMS ~1)
    params = {n: w * 4.0 if n.endswith("v_proj") else w for n, w in params.items()}
    params = quantize_params(params, shapes, bits=4, group_size=32)
    ids = jnp.asarray(seeded_rng().integers(0, cfg.vocab_size, (1, PREFILL + 2)), jnp.int32)
    outs = []
    for mm in (XLA, DispatchConfig(backend="pallas", attention="pallas", interpret=jax.default_backend() == "cpu")):
        t = models.make_target(cfg, params, mm)
        cache = models.init_cache(cfg, 1, CAPACITY, jnp.float32)
        fwd = jax.jit(models.forward)
        lp, _, cache = fwd(t, ids[:, :PREFILL], cache)
        steps = []
        for i in range(PREFILL, PREFILL + 2):
            ld, _, cache = fwd(t, ids[:, i:i + 1], cache)
            steps.append(ld)
        outs.append((lp, *steps, cache))
    for a, b in zip(outs[0][:3], outs[1][:3]):
        assert rel_err(b, a) < TOL
    # The cache where it is read: positions below the length. Slots past it may hold a padded chunk's
    # rows on one path and nothing on the other (the dense XLA path pads a lone row less).
    ca, cb = outs[0][3], outs[1][3]
    np.testing.assert_array_equal(np.asarray(cb.lengths), np.asarray(ca.lengths))
    n = int(ca.lengths[0])
    assert n == PREFILL + 2
    for a, b in zip(ca.k + ca.v, cb.k + cb.v):
        if a.shape[-3] == ca.capacity:
            valid = np.arange(a.shape[-3]) < n
        else:  # a ring: the slots whose absolute position (pos) is a valid one
            np.testing.assert_array_equal(np.asarray(cb.pos), np.asarray(ca.pos))
            pos = np.asarray(ca.pos)[0]
            valid = (pos >= 0) & (pos < n)
        assert valid.sum() >= min(n, a.shape[-3]) - 1
        assert rel_err(np.asarray(b)[..., valid, :, :], np.asarray(a)[..., valid, :, :]) < TOL


@pytest.mark.parametrize("field,value,match", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0 is not supported"),
    ("rope_parameters", {F: {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}}, "rope_type'='yarn'"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("query_pre_attn_scalar", 0, "'query_pre_attn_scalar'=0 must be"),
    ("model_type", "gemma2", "unsupported model_type='gemma2'"),
])
def test_unsupported_fields_refused(field, value, match):
    d = dict(CONFIGS["base"], model_type="gemma3_text")
    d[field] = value
    with pytest.raises((ValueError, NotImplementedError), match=match):
        models.TargetConfig.from_dict(d)


def test_270m_preset_shapes_and_trace():
    """The gemma-3-270m preset: the GGUF's 268,098,176 parameters, and a 4-bit random model of that
    shape traces prefill and decode (abstractly: no weights are made)."""
    cfg = presets.target_config("gemma-3-270m")
    assert sum(math.prod(s) for s, _ in models.target_shapes(cfg).values()) == 268_098_176
    assert cfg.layer_types.count(F) == 3 and cfg.attention_scale == 1 / 16
    t = jax.eval_shape(lambda k: presets.random_model(cfg, k, matmul=XLA), jax.random.PRNGKey(0))
    cache = jax.eval_shape(lambda: models.init_cache(cfg, 1, 1024, jnp.bfloat16))
    for n in (600, 1):  # a prefill past the window, a decode step
        lg, h, _ = jax.eval_shape(models.forward, t, jax.ShapeDtypeStruct((1, n), jnp.int32), cache)
        assert lg.shape == (1, n, 262_144) and h.shape == (1, n, 640)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_270m_shapes_verify_is_bitwise_four_steps_on_a_cpu(dtype):
    """Greedy parity at batch 1 on a CPU rests on a [1, 4] verify giving each row the bits of a
    [1, 1] decode step. With Gemma 3 270M's widths (q/k norms over 4 x 256, norms over 640) a lone
    row did not (XLA's CPU reduce and division gave other bits at 1 row than at 4), and the real
    model's greedy text differed from classic decoding's; models.row_bucket now computes both at
    CPU_BUCKET rows. Random dense weights, the 270M widths, 2 layers, a small vocabulary."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's row bucket")
    import dataclasses

    full = presets.target_config("gemma-3-270m")
    keep = [4, 5]  # a sliding and a full layer
    cfg = dataclasses.replace(full, vocab_size=2048, num_hidden_layers=2,
                              **{f: tuple(getattr(full, f)[i] for i in keep)
                                 for f in ("layer_types", "layer_head_dims", "layer_kv_heads")})
    rng = seeded_rng()
    t = presets.random_model(cfg, jax.random.PRNGKey(int(rng.integers(1 << 30))), dtype=dtype, quantize=None,
                             matmul=DispatchConfig(backend="xla", dense=True))
    assert models.row_bucket(t, 1) == 4
    prefix = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, 5)), jnp.int32)
    block = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, 4)), jnp.int32)
    fwd = jax.jit(models.forward)
    _, _, cache = fwd(t, prefix, models.init_cache(cfg, 1, 32, dtype))
    wide_logits, wide_hidden, _ = fwd(t, block, cache)
    steps = []
    for j in range(4):
        lg, h, cache = fwd(t, block[:, j:j + 1], cache)
        steps.append((lg, h))
    assert np.array_equal(np.asarray(wide_logits), np.concatenate([np.asarray(s[0]) for s in steps], axis=1))
    assert np.array_equal(np.asarray(wide_hidden, np.float32),
                          np.concatenate([np.asarray(s[1], np.float32) for s in steps], axis=1))
