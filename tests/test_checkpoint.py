"""Checkpoint loading and saving: the MLX quantized layout as written by mlx itself, quantize-on-load,
save/load round trips, and clear errors for bad checkpoints before any compute."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import models
from models import presets
from models.config import FULL, SLIDING
from models.params import LINEAR
from pallas_kernels import DispatchConfig, QuantizedWeight, dequantize, quantize

mx = pytest.importorskip("mlx.core")

XLA = DispatchConfig(backend="xla")
S, F = SLIDING, FULL
TDICT = presets.tiny_target_dict(num_hidden_layers=3, layer_types=[S, S, F], attention_k_eq_v=True,
                                 tie_word_embeddings=False)
CFG = models.TargetConfig.from_dict(TDICT)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 6)), jnp.int32)
logits = jax.jit(models.logits)


def float_target(seed=0):
    return presets.random_model(CFG, jax.random.PRNGKey(seed), dtype=jnp.float32, quantize=None, matmul=XLA)


def host(a):
    """A float array as float32 (bf16 values are exact in it), any other (packed words, ids) as it is."""
    return np.asarray(a, np.float32) if jnp.issubdtype(a.dtype, jnp.floating) else np.asarray(a)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def to_mx(a):
    return mx.array(np.asarray(a, np.float32)).astype(mx.bfloat16)


def write_mlx_checkpoint(path, params):
    """Quantize with mlx.core.quantize and write with mx.save_safetensors, mlx-vlm style
    ("language_model.model." prefix, a multimodal `gemma4` config): 4-bit g32 by default, the layer-0
    down_proj 8-bit g64 through a per-module override, layer-1 o_proj left float (override false).
    Returns the float32 weights MLX's own dequantize gives (the reference)."""
    q_cfg = {"group_size": 32, "bits": 4, "mode": "affine",
             "language_model.model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
             "language_model.model.layers.1.self_attn.o_proj": False}
    tensors, deq = {}, {}
    shapes = models.target_shapes(CFG)
    for name, w in params.items():
        mod = "language_model.lm_head" if name == "lm_head" else "language_model.model." + name
        over = q_cfg.get(mod)
        if shapes[name][1] == LINEAR and over is not False:
            gs, bits = (over["group_size"], over["bits"]) if over else (32, 4)
            wq, s, b = mx.quantize(to_mx(w), group_size=gs, bits=bits)
            tensors.update({mod + ".weight": wq, mod + ".scales": s, mod + ".biases": b})
            deq[name] = np.array(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                                               group_size=gs, bits=bits))
        else:
            key = mod if name.endswith("layer_scalar") else mod + ".weight"
            tensors[key] = to_mx(w)
            deq[name] = np.array(to_mx(w).astype(mx.float32))
    os.makedirs(path, exist_ok=True)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), tensors, metadata={"format": "mlx"})
    cfg = {"model_type": "gemma4", "text_config": dict(TDICT), "tie_word_embeddings": False,
           "quantization": q_cfg, "quantization_config": q_cfg}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return deq


def test_mlx_written_checkpoint_loads_and_matches(tmp_path):
    deq = write_mlx_checkpoint(tmp_path / "mlx", float_target().params)
    t = models.load_target(str(tmp_path / "mlx"), dtype=jnp.float32, matmul=XLA)
    p = t.params
    assert isinstance(p["layers.0.mlp.down_proj"], QuantizedWeight) and p["layers.0.mlp.down_proj"].bits == 8
    assert isinstance(p["layers.2.self_attn.q_proj"], QuantizedWeight) and p["layers.2.self_attn.q_proj"].bits == 4
    assert not isinstance(p["layers.1.self_attn.o_proj"], QuantizedWeight)
    for name, w in p.items():  # our unpacking == MLX's dequantize, bit for bit
        got = dequantize(w, jnp.float32) if isinstance(w, QuantizedWeight) else w
        np.testing.assert_array_equal(np.asarray(got, np.float32), deq[name], err_msg=name)
    # and the quantized model computes what the float model of MLX's dequantized weights computes
    ref = models.Target(config=CFG, params={k: jnp.asarray(v) for k, v in deq.items()}, matmul=XLA)
    assert rel_err(logits(t, IDS), logits(ref, IDS)) < 1e-5


def test_quantize_on_load_matches_mlx_quantize(tmp_path):
    t = float_target(1)
    models.save(t, str(tmp_path / "f"))
    q = models.load_target(str(tmp_path / "f"), dtype=jnp.bfloat16, quantize={"bits": 4, "group_size": 32})
    for name in ("embed_tokens", "lm_head", "layers.1.mlp.down_proj", "layers.2.self_attn.k_proj"):
        w = q.params[name]
        assert isinstance(w, QuantizedWeight)
        wq, s, b = mx.quantize(to_mx(t.params[name]), group_size=32, bits=4)
        ww, ws, wb = w.to_mlx()
        np.testing.assert_array_equal(np.asarray(ww), np.array(wq), err_msg=name)
        # stored as the kernels read them (64-row tiles per group, [K/g, N] scales); the values are MLX's
        n, k = w.shape
        assert w.weight.shape == (-(-n // 64), k // 32, 64, 4) and w.scales.shape == (k // 32, n), name
        np.testing.assert_array_equal(np.asarray(ws, np.float32), np.array(s.astype(mx.float32)))
        np.testing.assert_array_equal(np.asarray(wb, np.float32), np.array(b.astype(mx.float32)))
    assert not isinstance(q.params["norm"], QuantizedWeight) and q.params["norm"].dtype == jnp.bfloat16


def test_save_load_round_trip_quantized_target_and_assistant(tmp_path):
    t = presets.random_model(CFG, jax.random.PRNGKey(2), dtype=jnp.bfloat16,
                             quantize={"bits": 4, "group_size": 32}, matmul=XLA)
    down8 = quantize(float_target(3).params["layers.0.mlp.down_proj"].astype(jnp.bfloat16), bits=8, group_size=64)
    t = t.replace(params={**t.params, "layers.0.mlp.down_proj": down8})  # a per-module override
    models.save(t, str(tmp_path / "t"), shard_bytes=64 << 10)  # several shards + index
    assert os.path.isfile(tmp_path / "t" / "model.safetensors.index.json")
    cfg = json.load(open(tmp_path / "t" / "config.json"))
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.layers.0.mlp.down_proj"]["bits"] == 8
    t2 = models.load_target(str(tmp_path / "t"), dtype=jnp.bfloat16, matmul=XLA)
    assert t2.config == t.config and set(t2.params) == set(t.params)
    down = t2.params["layers.0.mlp.down_proj"]  # loaded in the kernels' layout, its own format
    assert (down.bits, down.group_size) == (8, 64) and down.weight.shape == (1, 2, 64, 16)
    mlx = lambda w: w.to_mlx() if isinstance(w, QuantizedWeight) else (w,)
    for name, w in t.params.items():
        assert type(w) is type(t2.params[name]), name
        for a, b in zip(mlx(w), mlx(t2.params[name]), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(host(a), host(b), err_msg=name)
    # MLX reads the written format: its dequantize equals ours
    arrays = {}
    for f in os.listdir(tmp_path / "t"):
        if f.endswith(".safetensors"):
            arrays.update(mx.load(str(tmp_path / "t" / f)))
    e = t.params["embed_tokens"]
    mdeq = mx.dequantize(arrays["model.embed_tokens.weight"], arrays["model.embed_tokens.scales"].astype(mx.float32),
                         arrays["model.embed_tokens.biases"].astype(mx.float32), group_size=32, bits=4)
    np.testing.assert_array_equal(np.array(mdeq), np.asarray(dequantize(e, jnp.float32)))

    acfg = models.AssistantConfig.from_dict(presets.tiny_assistant_dict(TDICT, use_ordered_embeddings=True))
    a = presets.random_model(acfg, jax.random.PRNGKey(4), dtype=jnp.bfloat16, quantize={"bits": 4, "group_size": 32})
    models.save(a, str(tmp_path / "a"))
    a2 = models.load_assistant(str(tmp_path / "a"), dtype=jnp.bfloat16, target=t2)
    assert a2.config == a.config and a2.params["masked_embedding.token_ordering"].dtype == jnp.int32
    for name, w in a.params.items():
        for x, y in zip(mlx(w), mlx(a2.params[name]), strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            np.testing.assert_array_equal(host(x), host(y), err_msg=name)


def test_loading_resolves_the_dispatch_env_once(tmp_path, monkeypatch):
    """load_target / load_assistant / random_model read DispatchConfig.from_env() when matmul is not
    given, at load; a model built directly holds DispatchConfig() whatever the environment says, and
    row_bucket follows the model's own config."""
    t = float_target(7)
    models.save(t, str(tmp_path / "t"))
    acfg = models.AssistantConfig.from_dict(presets.tiny_assistant_dict(TDICT))
    a = presets.random_model(acfg, jax.random.PRNGKey(8), dtype=jnp.float32, quantize=None, matmul=XLA)
    models.save(a, str(tmp_path / "a"))
    monkeypatch.setenv("JAXSPEC_QMV_MULTIROW_MAX_ROWS", "4")
    t2 = models.load_target(str(tmp_path / "t"), dtype=jnp.float32)
    a2 = models.load_assistant(str(tmp_path / "a"), dtype=jnp.float32)
    r = presets.random_model(CFG, jax.random.PRNGKey(0), dtype=jnp.float32, quantize=None)
    for m in (t2, a2, r):
        assert m.matmul == DispatchConfig.from_env() and m.matmul.multirow_max_rows == 4
    assert models.row_bucket(t2, 1) == 4 and models.row_bucket(t2, 2) == 2
    direct = [models.Target(config=CFG, params=t2.params), models.make_target(CFG, t2.params),
              models.Assistant(config=acfg, params=a2.params), models.make_assistant(acfg, a2.params)]
    for m in direct:
        assert m.matmul == DispatchConfig() and m.matmul.multirow_max_rows == 8
    assert models.row_bucket(direct[0], 1) == 8
    assert models.load_target(str(tmp_path / "t"), dtype=jnp.float32, matmul=XLA).matmul is XLA
    monkeypatch.setenv("JAXSPEC_QMV_MULTIROW_MAX_ROWS", "2")  # read at load only
    assert t2.matmul.multirow_max_rows == 4 and models.row_bucket(t2, 1) == 4


# ---- bad input -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    models.save(float_target(5), str(path))
    return path


def rewrite(src, dst, edit_tensors=None, edit_config=None):
    from safetensors import safe_open
    os.makedirs(dst, exist_ok=True)
    with safe_open(os.path.join(src, "model.safetensors"), "numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    cfg = json.load(open(os.path.join(src, "config.json")))
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(cfg)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def test_missing_tensor_is_named(float_ckpt, tmp_path):
    path = rewrite(float_ckpt, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.k_norm"):
        models.load_target(path)


def test_unexpected_tensor_is_named(float_ckpt, tmp_path):
    def add(t):
        t["model.layers.0.mlp.extra_proj.weight"] = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.0\.mlp\.extra_proj\.weight"):
        models.load_target(rewrite(float_ckpt, tmp_path / "u", add))


def test_shape_mismatch_names_tensor_and_shapes(float_ckpt, tmp_path):
    def bad(t):
        t["model.layers.2.self_attn.q_proj.weight"] = np.ones((100, 64), np.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight.*\(100, 64\).*\(128, 64\)"):
        models.load_target(rewrite(float_ckpt, tmp_path / "s", bad))


def test_quantized_shape_mismatch_is_named(tmp_path):
    t = models.quantize_model(float_target(6), bits=4, group_size=32)
    models.save(t, str(tmp_path / "q"))

    def bad(ts):
        ts["model.layers.0.mlp.up_proj.scales"] = ts["model.layers.0.mlp.up_proj.scales"][:, :1]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.scales.*\(128, 1\).*\(128, 2\)"):
        models.load_target(rewrite(tmp_path / "q", tmp_path / "q2", bad))


@pytest.mark.parametrize("model_type,exc,msg", [
    ("llama", ValueError, "unsupported model_type='llama'"),
    ("gemma4_assistant", ValueError, "load_assistant"),
])
def test_unsupported_model_type(float_ckpt, tmp_path, model_type, exc, msg):
    path = rewrite(float_ckpt, tmp_path / "t", edit_config=lambda c: c.update(model_type=model_type))
    with pytest.raises(exc, match=msg):
        models.load_target(path)


def test_moe_config_not_implemented():
    with pytest.raises(NotImplementedError, match="MoE"):
        models.TargetConfig.from_dict(presets.tiny_target_dict(enable_moe_block=True, num_experts=4))


@pytest.mark.parametrize("edit,msg", [
    (dict(backbone_hidden_size=48), "backbone_hidden_size=48 != target hidden_size=64"),
    (dict(text=dict(vocab_size=320)), "vocab_size=320 != target vocab_size=256"),
    (dict(text=dict(head_dim=8)), r"layer 0 \(sliding_attention\) head_dim=8 != target layer 1 head_dim=16"),
    (dict(text=dict(global_head_dim=64)), r"layer 2 \(full_attention\) head_dim=64 != target layer 2 head_dim=32"),
    (dict(text=dict(num_key_value_heads=1)), r"num_key_value_heads=1 != target layer 1 num_key_value_heads=2"),
])
def test_assistant_that_does_not_fit_is_rejected(tmp_path, edit, msg):
    adict = presets.tiny_assistant_dict(TDICT, **edit)
    acfg = models.AssistantConfig.from_dict(adict)
    a = presets.random_model(acfg, jax.random.PRNGKey(0), dtype=jnp.float32, quantize=None)
    models.save(a, str(tmp_path / "a"))
    t = float_target()
    with pytest.raises(ValueError, match=msg):
        models.load_assistant(str(tmp_path / "a"), target=t)
    cache = models.init_cache(CFG, 1, 8, jnp.float32)
    with pytest.raises(ValueError, match=msg):  # draft_step checks too, at trace time
        models.draft_step(a, t, cache, jnp.zeros((1,), jnp.int32), jnp.ones((1, 64)), jnp.zeros((1,), jnp.int32))


def test_params_checked_when_building_a_model():
    p = dict(float_target().params)
    p.pop("norm")
    p["layers.0.self_attn.q_proj"] = jnp.ones((8, 64))
    with pytest.raises(ValueError, match=r"missing params \['norm'\].*'layers\.0\.self_attn\.q_proj' has shape \(8, 64\)"):
        models.make_target(CFG, p)


def test_eos_and_context_length_survive_save_and_load(tmp_path):
    """eos_token_id (int or list, also from a multimodal config's top level) and
    max_position_embeddings are parsed, saved and reloaded; generate stops on them by default."""
    from jaxspec.generate import _default_stop_ids
    text = {k: v for k, v in TDICT.items() if k not in ("eos_token_id", "max_position_embeddings")}
    d = {"model_type": "gemma4", "text_config": text, "tie_word_embeddings": False,
         "eos_token_id": [1, 106], "max_position_embeddings": 4096}
    cfg = models.TargetConfig.from_dict(d)
    assert cfg.eos_token_ids == (1, 106) and cfg.max_position_embeddings == 4096
    t = presets.random_model(cfg, jax.random.PRNGKey(3), dtype=jnp.float32, quantize=None, matmul=XLA)
    models.save(t, str(tmp_path / "t"))
    t2 = models.load_target(str(tmp_path / "t"), dtype=jnp.float32, matmul=XLA)
    assert t2.config.eos_token_ids == (1, 106) and t2.config.max_position_embeddings == 4096
    assert _default_stop_ids(t2) == (1, 106)
    with pytest.raises(ValueError, match="eos_token_id"):
        models.TargetConfig.from_dict({**TDICT, "eos_token_id": "</s>"})
