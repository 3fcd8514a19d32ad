"""Checkpoint loading and saving: the MLX quantized layout as written by mlx itself, quantize-on-load,
save/load round trips, and clear errors for bad checkpoints before any compute."""
import errno
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from safetensors.numpy import save_file

from jaxspec import models
from jaxspec.models import checkpoint_files, layer_scan, presets
from jaxspec.models.config import FULL, SLIDING
from jaxspec.models.params import LINEAR
from jaxspec.kernels import DispatchConfig, QuantizedWeight, dequantize, quantize
from support.seeds import seeded_int, seeded_rng

mx = pytest.importorskip("mlx.core")

# dense=False: these tests are about the stored (quantized) format, which a CPU's loaders would
# otherwise dequantize at load (DispatchConfig.dense, models.dense)
XLA = DispatchConfig(backend="xla", dense=False)
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


def per_layer(m):
    """A model's params under their per-layer names (a Target keeps its scanned layers stacked)."""
    return layer_scan.unstack_params(m.config, m.params) if isinstance(m, models.Target) else m.params


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
    deq = write_mlx_checkpoint(tmp_path / "mlx", per_layer(float_target()))
    t = models.load_target(str(tmp_path / "mlx"), dtype=jnp.float32, matmul=XLA)
    p = per_layer(t)
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
    q = models.load_target(str(tmp_path / "f"), dtype=jnp.bfloat16, quantize={"bits": 4, "group_size": 32},
                          matmul=XLA)
    for name in ("embed_tokens", "lm_head", "layers.1.mlp.down_proj", "layers.2.self_attn.k_proj"):
        w = per_layer(q)[name]
        assert isinstance(w, QuantizedWeight)
        wq, s, b = mx.quantize(to_mx(per_layer(t)[name]), group_size=32, bits=4)
        ww, ws, wb = w.to_mlx()
        np.testing.assert_array_equal(np.asarray(ww), np.array(wq), err_msg=name)
        # stored as the kernels read them (64-row tiles per group, [K/g, N] scales); the values are MLX's
        n, k = w.shape
        assert w.weight.shape == (-(-n // 64), k // 32, 64, 4) and w.scales.shape == (k // 32, n), name
        np.testing.assert_array_equal(np.asarray(ws, np.float32), np.array(s.astype(mx.float32)))
        np.testing.assert_array_equal(np.asarray(wb, np.float32), np.array(b.astype(mx.float32)))
    assert not isinstance(per_layer(q)["norm"], QuantizedWeight) and per_layer(q)["norm"].dtype == jnp.bfloat16


def test_save_load_round_trip_quantized_target_and_assistant(tmp_path):
    t = presets.random_model(CFG, jax.random.PRNGKey(2), dtype=jnp.bfloat16,
                             quantize={"bits": 4, "group_size": 32}, matmul=XLA)
    down8 = quantize(per_layer(float_target(3))["layers.0.mlp.down_proj"].astype(jnp.bfloat16), bits=8, group_size=64)
    t = t.replace(params={**per_layer(t), "layers.0.mlp.down_proj": down8})  # a per-module override
    models.save(t, str(tmp_path / "t"), shard_bytes=64 << 10)  # several shards + index
    assert os.path.isfile(tmp_path / "t" / "model.safetensors.index.json")
    cfg = json.load(open(tmp_path / "t" / "config.json"))
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.layers.0.mlp.down_proj"]["bits"] == 8
    t2 = models.load_target(str(tmp_path / "t"), dtype=jnp.bfloat16, matmul=XLA)
    assert t2.config == t.config and set(per_layer(t2)) == set(per_layer(t))
    down = per_layer(t2)["layers.0.mlp.down_proj"]  # loaded in the kernels' layout, its own format
    assert (down.bits, down.group_size) == (8, 64) and down.weight.shape == (1, 2, 64, 16)
    mlx = lambda w: w.to_mlx() if isinstance(w, QuantizedWeight) else (w,)
    for name, w in per_layer(t).items():
        assert type(w) is type(per_layer(t2)[name]), name
        for a, b in zip(mlx(w), mlx(per_layer(t2)[name]), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(host(a), host(b), err_msg=name)
    # MLX reads the written format: its dequantize equals ours
    arrays = {}
    for f in os.listdir(tmp_path / "t"):
        if f.endswith(".safetensors"):
            arrays.update(mx.load(str(tmp_path / "t" / f)))
    e = per_layer(t)["embed_tokens"]
    mdeq = mx.dequantize(arrays["model.embed_tokens.weight"], arrays["model.embed_tokens.scales"].astype(mx.float32),
                         arrays["model.embed_tokens.biases"].astype(mx.float32), group_size=32, bits=4)
    np.testing.assert_array_equal(np.array(mdeq), np.asarray(dequantize(e, jnp.float32)))

    acfg = models.AssistantConfig.from_dict(presets.tiny_assistant_dict(TDICT, use_ordered_embeddings=True))
    a = presets.random_model(acfg, jax.random.PRNGKey(4), dtype=jnp.bfloat16, quantize={"bits": 4, "group_size": 32})
    models.save(a, str(tmp_path / "a"))
    a2 = models.load_assistant(str(tmp_path / "a"), dtype=jnp.bfloat16, target=t2, matmul=XLA)
    assert a2.config == a.config and per_layer(a2)["masked_embedding.token_ordering"].dtype == jnp.int32
    for name, w in per_layer(a).items():
        for x, y in zip(mlx(w), mlx(per_layer(a2)[name]), strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            np.testing.assert_array_equal(host(x), host(y), err_msg=name)


def test_loading_resolves_the_dispatch_env_once(tmp_path, monkeypatch):
    """load_target / load_assistant / random_model read DispatchConfig.from_env(backend="auto") when matmul is not
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
    auto = DispatchConfig.from_env(backend="auto")
    # the presets make models to save, train or shard: their weights stay quantized (dense off)
    for m, want in ((t2, auto), (a2, auto), (r, auto.replace(dense=False))):
        assert m.matmul == want and m.matmul.multirow_max_rows == 4
    # a lone row on a CPU's xla backend takes CPU_BUCKET (models.row_bucket); elsewhere the window's 4
    alone = models.target.CPU_BUCKET if t2.matmul.backend == "xla" and jax.default_backend() == "cpu" else 4
    assert models.row_bucket(t2, 1) == alone and models.row_bucket(t2, 2) == 2
    direct = [models.Target(config=CFG, params=per_layer(t2)), models.make_target(CFG, per_layer(t2)),
              models.Assistant(config=acfg, params=a2.params), models.make_assistant(acfg, a2.params)]
    for m in direct:
        assert m.matmul == DispatchConfig() and m.matmul.multirow_max_rows == 16
    # the 16-row window: 8 tokens at B = 1 and 2 (MAX_BUCKET), then window // B
    assert [models.row_bucket(direct[0], b) for b in (1, 2, 3, 4, 5, 16, 17)] == [8, 8, 5, 4, 3, 1, 1]
    assert models.load_target(str(tmp_path / "t"), dtype=jnp.float32, matmul=XLA).matmul is XLA
    monkeypatch.setenv("JAXSPEC_QMV_MULTIROW_MAX_ROWS", "2")  # read at load only
    assert t2.matmul.multirow_max_rows == 4 and models.row_bucket(t2, 2) == 2


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


@pytest.mark.parametrize("edit, msg", [
    (dict(layer_types="sliding_attention"), r"'layer_types' must be a list of \('sliding_attention', 'full_attention'\), "
                                            r"got 'sliding_attention'"),
    (dict(layer_types=[S, ["x"], "local"]), r"unsupported layer_types \['local', \['x'\]\]"),
    (dict(tie_word_embeddings="false"), r"'tie_word_embeddings'='false' must be true or false"),
    (dict(enable_moe_block="no"), r"'enable_moe_block'='no' must be true or false"),
    (dict(rms_norm_eps="1e-6"), r"'rms_norm_eps'='1e-6' must be a finite number"),
    (dict(final_logit_softcapping=float("nan")), r"'final_logit_softcapping'=nan must be a finite number"),
    (dict(hidden_size=float("inf")), r"'hidden_size'=inf must be an integer"),
    (dict(hidden_size_per_layer_input="8"), r"'hidden_size_per_layer_input'='8' must be an integer"),
    (dict(max_position_embeddings="4096"), r"'max_position_embeddings'='4096' must be an integer"),
    (dict(max_position_embeddings=0), r"'max_position_embeddings'=0 must be an integer in \[1, "),
    (dict(rope_parameters=[1, 2]), r"'rope_parameters' must be a dict, got \[1, 2\]"),
    (dict(per_layer_config={"2": 64}), r"'per_layer_config' must map layer indices to dicts"),
])
def test_config_fields_of_the_wrong_type_are_named(edit, msg):
    with pytest.raises(ValueError, match=msg):
        models.TargetConfig.from_dict({**TDICT, **edit})


@pytest.mark.parametrize("edit, msg", [
    (dict(backbone_hidden_size="64"), r"'backbone_hidden_size'='64' must be an integer"),
    (dict(num_centroids=2.5), r"'num_centroids'=2\.5 must be an integer"),
    (dict(use_ordered_embeddings="true"), r"'use_ordered_embeddings'='true' must be true or false"),
])
def test_assistant_config_fields_of_the_wrong_type_are_named(edit, msg):
    with pytest.raises(ValueError, match=msg):
        models.AssistantConfig.from_dict({**presets.tiny_assistant_dict(TDICT), **edit})


def test_quantization_config_of_the_wrong_type_is_named(float_ckpt, tmp_path):
    t = models.quantize_model(float_target(seeded_int(1 << 30)), bits=4, group_size=32)
    models.save(t, str(tmp_path / "q"))
    for q, msg in ((dict(bits="4", group_size=32), r"'quantization\.bits'='4' must be one of"),
                   ("4-bit", r"'quantization' must be a dict, got '4-bit'")):
        path = rewrite(tmp_path / "q", tmp_path / "q2", edit_config=lambda c: c.update(quantization=q))
        with pytest.raises(ValueError, match=msg):
            models.load_target(path)


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
    p = dict(per_layer(float_target()))
    p.pop("norm")
    p["layers.0.self_attn.q_proj"] = jnp.ones((8, 64))
    with pytest.raises(ValueError, match=r"missing params \['norm'\].*'layers\.0\.self_attn\.q_proj' has shape \(8, 64\)"):
        models.make_target(CFG, p)


def test_eos_and_context_length_survive_save_and_load(tmp_path):
    """eos_token_id (int or list, also from a multimodal config's top level) and
    max_position_embeddings are parsed, saved and reloaded; generate stops on them by default."""
    from jaxspec.engine.generate import _default_stop_ids
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


# ---- atomic saves (the kill test is tests/models/test_checkpoint_kill.py) ---------------------------------
MANIFEST = checkpoint_files.MANIFEST


def snapshot(path):
    """{file name: bytes} of a directory (the whole state a failed save must leave as it was)."""
    return {f: (path / f).read_bytes() for f in sorted(os.listdir(path))}


def assert_same_params(m, ref):
    assert set(per_layer(m)) == set(per_layer(ref))
    for name, w in per_layer(ref).items():
        np.testing.assert_array_equal(host(per_layer(m)[name]), host(w), err_msg=name)


@pytest.fixture
def old_ckpt(tmp_path):
    """A sharded float checkpoint (several model-*-of-* files + index) with two foreign files beside it."""
    seed = seeded_int(1 << 30)
    t = float_target(seed)
    path = tmp_path / "ckpt"
    models.save(t, str(path), shard_bytes=64 << 10)
    save_file({"lora_a": np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)},
              str(path / "adapter_lora.safetensors"))
    (path / "tokenizer.json").write_text('{"not": "touched"}')
    assert len([f for f in os.listdir(path) if f.startswith("model-")]) >= 3
    return t, path


def test_save_keeps_foreign_files_and_drops_stale_shards(old_ckpt, tmp_path):
    t, path = old_ckpt
    foreign = {f: (path / f).read_bytes() for f in ("adapter_lora.safetensors", "tokenizer.json")}
    # the loader reads the manifest's files only: the adapter beside the model is not a shard
    assert_same_params(models.load_target(str(path), dtype=jnp.float32, matmul=XLA), t)
    # fewer shards: the index and the manifest name exactly the new ones, the old ones are gone
    n_before = len([f for f in os.listdir(path) if f.startswith("model-")])
    t2 = float_target(seeded_int(1 << 30))
    models.save(t2, str(path), shard_bytes=256 << 10)
    shards = sorted(f for f in os.listdir(path) if f.startswith("model-"))
    assert 1 < len(shards) < n_before
    index = json.load(open(path / "model.safetensors.index.json"))
    assert sorted(set(index["weight_map"].values())) == shards
    assert sorted(json.load(open(path / MANIFEST))["weights"]) == shards
    assert_same_params(models.load_target(str(path), dtype=jnp.float32, matmul=XLA), t2)
    # one shard: no index is left pointing at old shards
    t3 = float_target(seeded_int(1 << 30))
    models.save(t3, str(path))
    assert sorted(os.listdir(path)) == ["adapter_lora.safetensors", "config.json", MANIFEST, "model.safetensors",
                                        "tokenizer.json"]
    assert_same_params(models.load_target(str(path), dtype=jnp.float32, matmul=XLA), t3)
    assert {f: (path / f).read_bytes() for f in foreign} == foreign
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing written beside it


def test_save_into_a_new_directory_and_over_a_file(tmp_path):
    t = float_target(seeded_int(1 << 30))
    path = tmp_path / "a" / "b" / "ckpt"
    models.save(t, str(path))
    assert sorted(os.listdir(path)) == ["config.json", MANIFEST, "model.safetensors"]
    assert sorted(os.listdir(path.parent)) == ["ckpt"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o777 & ~umask  # a normal directory, not mkdtemp's 0700
    assert_same_params(models.load_target(str(path), dtype=jnp.float32, matmul=XLA), t)
    f = tmp_path / "file"
    f.write_text("precious")
    with pytest.raises(ValueError, match=r"cannot save a checkpoint to .*file'.*not a directory"):
        models.save(t, str(f))
    assert f.read_text() == "precious" and sorted(os.listdir(tmp_path)) == ["a", "file"]


def _nth_call_fails(n, real, fail):
    """A stand-in for `real` whose n-th call (1-based) runs `fail` (which raises) instead; returns it
    and its call counter."""
    calls = [0]

    def fake(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            fail(*args, **kwargs)
        return real(*args, **kwargs)
    return fake, calls


def _disk_full(*_, **__):
    raise OSError(errno.ENOSPC, "No space left on device")


def _half_written_then_disk_full(tensors, fn, metadata=None):
    save_file(tensors, fn, metadata=metadata)
    with open(fn, "r+b") as f:
        f.truncate(os.path.getsize(fn) // 2)
    _disk_full()


REPLACE = os.replace


@pytest.mark.parametrize("where", ["save_file 1", "save_file 3", "json.dump", "fsync 2", "os.replace 1",
                                   "os.replace 2", "os.replace 4", "os.replace last", "dir fsync after the switch"])
def test_failed_save_leaves_the_old_or_the_new_checkpoint(old_ckpt, tmp_path, monkeypatch, where):
    """Whatever fails (a write that fills the disk half way, config.json, an fsync, any rename, the
    directory fsync after the switch) the error is raised, and the directory holds the old checkpoint
    byte for byte when it failed before the switch (the manifest's rename, os.replace 1), else the
    new one as the loader reads it; the next save leaves no trace of the failed one and the foreign
    files are intact. The new save has fewer shards with other names, so deleting stale files is
    part of it."""
    t, path = old_ckpt
    before = snapshot(path)
    new = float_target(seeded_int(1 << 30))
    kind, _, arg = where.partition(" ")
    if kind == "save_file":
        fake, _ = _nth_call_fails(int(arg), safetensors.numpy.save_file, _half_written_then_disk_full)
        monkeypatch.setattr(safetensors.numpy, "save_file", fake)
    elif kind == "json.dump":
        monkeypatch.setattr(json, "dump", _nth_call_fails(1, json.dump, _disk_full)[0])
    elif kind == "fsync":
        monkeypatch.setattr(os, "fsync", _nth_call_fails(int(arg), os.fsync, _disk_full)[0])
    elif kind == "os.replace":
        if arg == "last":  # the number of renames a successful save of the same kind makes
            shutil.copytree(path, tmp_path / "probe")
            counter, calls = _nth_call_fails(0, REPLACE, None)
            monkeypatch.setattr(os, "replace", counter)
            models.save(new, str(tmp_path / "probe"), shard_bytes=256 << 10)
            shutil.rmtree(tmp_path / "probe")
            arg = calls[0]
            assert arg > 4

        def rename_fails(*_):
            raise OSError(errno.EIO, "injected rename failure")
        monkeypatch.setattr(os, "replace", _nth_call_fails(int(arg), REPLACE, rename_fails)[0])
    else:
        real = checkpoint_files._fsync_dir
        monkeypatch.setattr(checkpoint_files, "_fsync_dir", lambda p: _disk_full() if p == str(path) else real(p))
    with pytest.raises(OSError, match="No space left|injected"):
        models.save(new, str(path), shard_bytes=256 << 10)
    monkeypatch.undo()
    switched = json.load(open(path / MANIFEST)) != json.loads(before[MANIFEST])
    assert switched == (kind == "os.replace" and arg != "1" or kind == "dir"), where
    if not switched:
        assert snapshot(path) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_same_params(models.load_target(str(path), dtype=jnp.float32, matmul=XLA), new if switched else t)
    t3 = float_target(seeded_int(1 << 30))
    models.save(t3, str(path))
    assert sorted(os.listdir(path)) == ["adapter_lora.safetensors", "config.json", MANIFEST, "model.safetensors",
                                        "tokenizer.json"]
    assert {f: (path / f).read_bytes() for f in ("adapter_lora.safetensors", "tokenizer.json")} == {
        f: before[f] for f in ("adapter_lora.safetensors", "tokenizer.json")}
    assert_same_params(models.load_target(str(path), dtype=jnp.float32, matmul=XLA), t3)


# ---- unloadable files: ValueError naming the file, before any tensor is read --------------------------
def _truncate(fn, keep):
    data = open(fn, "rb").read()
    open(fn, "wb").write(data[:keep(len(data))])


def _corrupt_header(fn):
    data = bytearray(open(fn, "rb").read())
    data[8:24] = b"#" * 16  # the JSON header's first bytes
    open(fn, "wb").write(bytes(data))


@pytest.mark.parametrize("case, msg", [
    ("empty", r"'model-00002-of-\d+\.safetensors' is empty"),
    ("truncated", r"'model-00002-of-\d+\.safetensors' is not a valid safetensors file \(truncated or corrupt"),
    ("header only", r"'model-00002-of-\d+\.safetensors' is not a valid safetensors file"),
    ("corrupt header", r"'model-00002-of-\d+\.safetensors' is not a valid safetensors file"),
    ("missing shard", r"model\.safetensors\.index\.json names weight file\(s\) \['model-00002-of-\d+\.safetensors'\] "
                      "that do not exist"),
    ("index not JSON", r"model\.safetensors\.index\.json is not readable JSON"),
    ("index without weight_map", r"model\.safetensors\.index\.json has no 'weight_map'"),
    ("index naming a path", r"model\.safetensors\.index\.json's weight_map must map tensor names to file names in the directory"),
    ("config not JSON", r"config\.json is not readable JSON"),
])
def test_unloadable_files_are_named_before_reading_tensors(tmp_path, monkeypatch, case, msg):
    from jaxspec.models import checkpoint
    path = tmp_path / "c"
    models.save(float_target(seeded_int(1 << 30)), str(path), shard_bytes=64 << 10)
    os.remove(path / MANIFEST)  # the index's rules, as for a checkpoint another tool wrote (manifests: below)
    shard = str(next(path.glob("model-00002-of-*.safetensors")))
    index = path / "model.safetensors.index.json"
    if case == "empty":
        open(shard, "wb").close()
    elif case == "truncated":
        _truncate(shard, lambda n: n - seeded_int(1, n // 2))
    elif case == "header only":
        _truncate(shard, lambda n: 8 + int.from_bytes(open(shard, "rb").read(8), "little"))
    elif case == "corrupt header":
        _corrupt_header(shard)
    elif case == "missing shard":
        os.remove(shard)
    elif case == "index not JSON":
        index.write_text('{"weight_map": {')
    elif case == "index without weight_map":
        index.write_text('{"metadata": {}}')
    elif case == "index naming a path":
        wm = json.loads(index.read_text())
        wm["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
        index.write_text(json.dumps(wm))
    else:
        (path / "config.json").write_text('{"model_type": "gemma4_text", ')

    def no_tensor_is_read(*a, **k):
        raise AssertionError("tensor data read before the files were checked")
    monkeypatch.setattr(checkpoint, "_Progress", no_tensor_is_read)
    with pytest.raises(ValueError, match=rf"checkpoint '.*c' is not loadable: {msg}"):
        models.load_target(str(path), matmul=XLA)


def test_a_file_changed_after_the_save_is_named(float_ckpt, tmp_path):
    """With a manifest the sizes it records are checked before anything is read; a bad manifest is
    named and says how to load the directory without it."""
    path = tmp_path / "c"
    shutil.copytree(float_ckpt, path)
    _truncate(path / "model.safetensors", lambda n: n - seeded_int(1, n // 2))
    size = os.path.getsize(path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"not loadable: '.*model\.safetensors' has {size} bytes where {MANIFEST} "
                                         r"records \d+: it changed after models.save wrote it"):
        models.load_target(str(path), matmul=XLA)
    (path / MANIFEST).write_text('{"files": ["config.json"]}')
    with pytest.raises(ValueError, match=rf"{MANIFEST} is not a manifest models.save wrote \(remove it"):
        models.load_target(str(path), matmul=XLA)


def test_only_model_safetensors_are_weights(tmp_path):
    """Without an index the weights are model*.safetensors: an adapter beside them is not read, and a
    directory with only other *.safetensors files says so."""
    t = float_target(seeded_int(1 << 30))
    models.save(t, str(tmp_path / "t"))
    save_file({"model.norm.weight": np.zeros(64, np.float32)}, str(tmp_path / "t" / "adapter_lora.safetensors"))
    assert_same_params(models.load_target(str(tmp_path / "t"), dtype=jnp.float32, matmul=XLA), t)
    os.remove(tmp_path / "t" / MANIFEST)  # the rule of a checkpoint another tool wrote
    assert_same_params(models.load_target(str(tmp_path / "t"), dtype=jnp.float32, matmul=XLA), t)
    os.remove(tmp_path / "t" / "model.safetensors")
    with pytest.raises(ValueError, match=r"no model\*\.safetensors files in .*\['adapter_lora\.safetensors'\] are not read"):
        models.load_target(str(tmp_path / "t"))


# ---- non-finite values ------------------------------------------------------------------------------
def test_nan_norm_is_refused_naming_the_tensor(float_ckpt, tmp_path):
    def nan_norm(ts):
        ts["model.norm.weight"] = np.full_like(ts["model.norm.weight"], np.nan)
    path = rewrite(float_ckpt, tmp_path / "n", nan_norm)
    with pytest.raises(ValueError, match=r"not loadable: 1 tensor\(s\) hold NaN or inf values as bfloat16: "
                                         r"'model\.norm\.weight' \(64 NaN and 0 inf of 64 values"):
        models.load_target(path, matmul=XLA)


def test_inf_scale_and_layer_scalar_are_refused(tmp_path):
    rng = seeded_rng()
    t = models.quantize_model(float_target(int(rng.integers(1 << 30))), bits=4, group_size=32)
    models.save(t, str(tmp_path / "q"))
    row, col = int(rng.integers(0, 128)), int(rng.integers(0, 2))

    def bad(ts):
        ts["model.layers.1.mlp.up_proj.scales"][row, col] = np.inf
        ts["model.layers.2.layer_scalar"][...] = np.nan
    path = rewrite(tmp_path / "q", tmp_path / "q2", bad)
    with pytest.raises(ValueError, match=rf"2 tensor\(s\).*'model\.layers\.1\.mlp\.up_proj\.scales' \(0 NaN and 1 inf "
                                         rf"of 256 values, the first at index \({row}, {col}\)\).*"
                                         r"'model\.layers\.2\.layer_scalar'"):
        models.load_target(path, matmul=XLA)


def test_non_finite_float_weight_refused_when_quantized_on_load_and_when_cast(float_ckpt, tmp_path):
    def nan_weight(ts):
        ts["model.layers.0.self_attn.q_proj.weight"][3, 5] = np.nan
    path = rewrite(float_ckpt, tmp_path / "w", nan_weight)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\.weight': weight has "
                                         r"non-finite values \(1 NaN and 0 inf .* index \(3, 5\)"):
        models.load_target(path, quantize={"bits": 4, "group_size": 32}, matmul=XLA)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight'"):
        models.load_target(path, matmul=XLA)

    def huge(ts):  # finite in float32, inf once cast to float16
        ts["model.layers.1.mlp.down_proj.weight"][0, 0] = 1e6
    path = rewrite(float_ckpt, tmp_path / "h", huge)
    models.load_target(path, dtype=jnp.float32, matmul=XLA)
    with pytest.raises(ValueError, match=r"as float16: 'model\.layers\.1\.mlp\.down_proj\.weight' \(0 NaN and 1 inf"):
        models.load_target(path, dtype=jnp.float16, matmul=XLA)


def test_quantize_model_names_a_non_finite_param():
    rng = seeded_rng()
    t = float_target(int(rng.integers(1 << 30)))
    w = np.array(per_layer(t)["layers.1.mlp.up_proj"])
    i, j = int(rng.integers(0, w.shape[0])), int(rng.integers(0, w.shape[1]))
    w[i, j] = -np.inf
    bad = t.replace(params={**per_layer(t), "layers.1.mlp.up_proj": jnp.asarray(w)})
    with pytest.raises(ValueError, match=rf"param 'layers\.1\.mlp\.up_proj': weight has non-finite values "
                                         rf"\(0 NaN and 1 inf of {w.size} values, the first at index \({i}, {j}\)\)"):
        models.quantize_model(bad, bits=4, group_size=32)
