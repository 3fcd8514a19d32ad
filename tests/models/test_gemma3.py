"""Gemma 3, the second model family, against transformers' Gemma3ForCausalLM (torch float32, eager):
tiny random models saved with save_pretrained and loaded with models.load_target (prefill, then
step-by-step decode through the cache and its sliding ring), the config parser and the registry.
What needs no transformers (the kernels, the 270M's shapes, refusals) is test_gemma3_family.py, so it
runs where transformers is older (the GPU machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.24")

from jaxspec import models  # noqa: E402
from jaxspec.models import families  # noqa: E402
from support.hf_models import hf_gemma3  # noqa: E402
from support.gemma3_configs import CAPACITY, CONFIGS, DECODE, PREFILL, TOL, XLA, F, S, rel_err  # noqa: E402, F401
from support.seeds import seeded_rng  # noqa: E402


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
