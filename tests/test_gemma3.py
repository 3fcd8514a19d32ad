"""Gemma 3, the second model family, against transformers' Gemma3ForCausalLM (torch float32, eager):
tiny random models saved with save_pretrained and loaded with models.load_target (prefill, then
step-by-step decode through the cache and its sliding ring), the config parser and the registry."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.24")

from jaxspec import models  # noqa: E402
from jaxspec.kernels import DispatchConfig  # noqa: E402
from jaxspec.models import families, presets  # noqa: E402
from jaxspec.models.config import FULL, SLIDING  # noqa: E402
from jaxspec.models.params import quantize_params  # noqa: E402
from hf_models import hf_gemma3  # noqa: E402
from seeds import seeded_rng  # noqa: E402

XLA = DispatchConfig(backend="xla")
S, F = SLIDING, FULL
PREFILL, DECODE = 20, 8  # prefill > ROW_TILE (blocked attention), then one token at a time
CAPACITY = 32            # > window + ROW_TILE + 1: the sliding layers keep a ring

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
             rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=256,
             pad_token_id=0, bos_token_id=2, eos_token_id=1)
# Each Gemma 3 choice on in one config, off in the other. "base": a last layer that is sliding (HF
# keeps it; Gemma 4 forces it full), a scale query_pre_attn_scalar**-0.5 that is not a power of two,
# linear RoPE scaling on the full layer, tied head, no softcap. "pattern": layer_types absent (HF's
# 5 : 1 default), one KV head, an untied head, a final softcap that bites.
CONFIGS = {
    "base": dict(_BASE, num_hidden_layers=3, layer_types=[S, F, S], num_key_value_heads=2, sliding_window=4,
                 query_pre_attn_scalar=24, final_logit_softcapping=None, tie_word_embeddings=True,
                 rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                                  F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}),
    "pattern": dict(_BASE, num_hidden_layers=6, num_key_value_heads=1, sliding_window=3, query_pre_attn_scalar=16,
                    final_logit_softcapping=5.0, tie_word_embeddings=False),
}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# Both sides compute in float32, in different orders (torch's matmuls and einsums vs XLA's, our
# blocked online softmax vs a full softmax): per-op relative differences ~1e-7, a few layers deep.
# 1e-4 of the largest logit leaves two orders of margin, while any Gemma 3 difference done wrong
# (norm w instead of 1 + w, scale 1 instead of 24**-0.5, a swapped RoPE base, the factor, a v norm)
# moves logits by O(1) of it.
TOL = 1e-4


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    hf = hf_gemma3(CONFIGS[request.param], seed=int(seeded_rng().integers(1 << 30)))
    path = tmp_path_factory.mktemp("gemma3_" + request.param)
    hf.save_pretrained(path)
    target = models.load_target(str(path), dtype=jnp.float32, matmul=XLA)
    ids = seeded_rng().integers(0, CONFIGS[request.param]["vocab_size"], size=(2, PREFILL + DECODE))
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    return dict(name=request.param, hf=hf, target=target, ids=ids, ref=ref)


def test_config_parsed_like_hf(case):
    cfg, hf_cfg = case["target"].config, case["hf"].config
    assert cfg.model_type == "gemma3_text" and cfg.family is families.family_of("gemma3_text")
    assert cfg.layer_types == tuple(hf_cfg.layer_types)
    assert cfg.attention_scale == case["hf"].model.layers[0].self_attn.scaling
    assert cfg.rope_full.theta == hf_cfg.rope_parameters[F]["rope_theta"]
    assert cfg.rope_sliding.theta == hf_cfg.rope_parameters[S]["rope_theta"]
    assert "layers.0.layer_scalar" not in models.target_shapes(cfg)
    assert models.TargetConfig.from_dict(cfg.to_dict()) == cfg  # the writer round-trips


def test_prefill_and_decode_match_hf(case):
    """Prefill PREFILL tokens, then DECODE single-token steps through the same cache (a ring on the
    sliding layers): every position's logits against HF's full-sequence forward."""
    target, ids, ref = case["target"], case["ids"], case["ref"]
    cache = models.init_cache(target.config, 2, CAPACITY, jnp.float32)
    assert cache.pos is not None  # the sliding layers hold a ring, not the whole capacity
    fwd = jax.jit(models.forward)
    logits, _, cache = fwd(target, jnp.asarray(ids[:, :PREFILL], jnp.int32), cache)
    assert rel_err(logits, ref[:, :PREFILL]) < TOL
    steps = []
    for t in range(PREFILL, PREFILL + DECODE):
        step, _, cache = fwd(target, jnp.asarray(ids[:, t:t + 1], jnp.int32), cache)
        steps.append(np.asarray(step[:, 0]))
    steps = np.stack(steps, axis=1)
    assert rel_err(steps, ref[:, PREFILL:]) < TOL
    assert np.array_equal(steps.argmax(-1), ref[:, PREFILL:].argmax(-1))


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
    for mm in (XLA, DispatchConfig(backend="pallas", attention="pallas", interpret=True)):
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


def test_save_load_roundtrip(case, tmp_path):
    """`save` writes a gemma3_text checkpoint (HF names, Gemma3ForCausalLM) that loads back equal."""
    models.save(case["target"], str(tmp_path))
    back = models.load_target(str(tmp_path), dtype=jnp.float32, matmul=XLA)
    assert back.config == case["target"].config
    assert sorted(back.params) == sorted(case["target"].params)
    for name, w in case["target"].params.items():
        np.testing.assert_array_equal(back.params[name], w, err_msg=name)
    import json
    assert json.load(open(tmp_path / "config.json"))["architectures"] == ["Gemma3ForCausalLM"]


def test_wrapper_and_legacy_fields_parse():
    """gemma3 (its text_config, the top-level tie flag) and the pre-5.x flat RoPE fields
    (rope_theta, rope_local_base_freq, rope_scaling for the full layers) parse as HF reads them."""
    from transformers import Gemma3TextConfig

    text = dict(CONFIGS["pattern"], model_type="gemma3_text", rope_theta=500_000.0, rope_local_base_freq=20_000.0,
                rope_scaling={"rope_type": "linear", "factor": 8.0})
    ours = models.TargetConfig.from_dict(dict(model_type="gemma3", text_config=text, tie_word_embeddings=True))
    hf = Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    assert ours.tie_word_embeddings and ours.layer_types == tuple(hf.layer_types)
    assert ours.rope_full.theta == hf.rope_parameters[F]["rope_theta"] == 500_000.0
    assert ours.rope_full.factor == hf.rope_parameters[F]["factor"] == 8.0
    assert ours.rope_sliding.theta == hf.rope_parameters[S]["rope_theta"] == 20_000.0
    assert ours.rope_sliding.rope_type == "default"


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
