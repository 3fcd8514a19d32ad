"""Gemma 4: gemma4_text, gemma4_unified_text, and the text part of gemma4 / gemma4_unified (their
`text_config`); and the config of its MTP assistant (gemma4_assistant, gemma4_unified_assistant),
whose text stack is read by the same parser.

The family jaxspec was written for, so TargetConfig's family fields default to its numerics (RMSNorm
by w, attention scale 1.0, v RMSNorm'd without a scale, a scalar per layer). Every field is read from
the dict; a field that is absent takes the HF transformers 5.24 default of the config class named by
`model_type` (mlx-lm's defaults differ, which is why nothing is assumed). Head dims and KV heads may
differ per layer (`per_layer_config`, or Google's / mlx-lm's `global_head_dim` and, with K=V,
`num_global_key_value_heads`); RoPE is "default" on sliding layers and "proportional" (partial) on
full ones.
"""
from __future__ import annotations

from typing import Any

from .config_fields import (ACTIVATIONS, FULL, LAYER_TYPES, SLIDING, RopeConfig, choice, eos_ids, flag, int_field, join,
                            number, short)
from .family_spec import Family

TARGET_TYPES = ("gemma4_text", "gemma4_unified_text")
MULTIMODAL_TYPES = ("gemma4", "gemma4_unified")
ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
ROPE_TYPES = ("default", "proportional")

# HF 5.24 defaults of Gemma4TextConfig; Gemma4UnifiedTextConfig overrides a few and has no PLE/MoE.
_TEXT_DEFAULTS = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, sliding_window=512,
    final_logit_softcapping=None, use_bidirectional_attention=None, vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256, attention_k_eq_v=False, num_kv_shared_layers=0,
    enable_moe_block=False, use_double_wide_mlp=False, global_head_dim=512,
    num_global_key_value_heads=None,
)
_UNIFIED_TEXT_DEFAULTS = dict(_TEXT_DEFAULTS, sliding_window=1024, use_bidirectional_attention="vision",
                              hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


def parse(d: dict[str, Any]) -> dict[str, Any]:
    """The TargetConfig fields of a gemma4_text / gemma4_unified_text config dict, or of a gemma4 /
    gemma4_unified one (its `text_config`, with the top level's head flag, eos and context)."""
    mt = d.get("model_type")
    if mt in MULTIMODAL_TYPES:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"model_type={mt!r} config has no 'text_config' dict")
        text = dict(text)
        text.setdefault("model_type", "gemma4_unified_text" if mt == "gemma4_unified" else "gemma4_text")
        if "tie_word_embeddings" in d:  # the top-level flag decides the multimodal model's head
            text["tie_word_embeddings"] = d["tie_word_embeddings"]
        for key in ("eos_token_id", "max_position_embeddings"):  # often only at the top level
            if text.get(key) is None and d.get(key) is not None:
                text[key] = d[key]
        return text_fields(text)
    return text_fields(d)  # one of TARGET_TYPES (families.family_of checked)


def text_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The TargetConfig fields of a Gemma 4 text config dict (a target's, or an assistant's text_config)."""
    mt = d.get("model_type", "gemma4_text")
    if mt not in TARGET_TYPES:
        raise ValueError(f"unsupported text_config model_type={short(mt)}: expected one of {TARGET_TYPES}")
    defaults = _UNIFIED_TEXT_DEFAULTS if mt == "gemma4_unified_text" else _TEXT_DEFAULTS

    def get(key):
        v = d.get(key, defaults.get(key))
        return defaults.get(key) if v is None and key in ("hidden_size_per_layer_input",
                                                          "vocab_size_per_layer_input") else v

    if flag("enable_moe_block", get("enable_moe_block")):
        raise NotImplementedError("Gemma 4 MoE configs (enable_moe_block=true, e.g. 26B-A4B) are not "
                                  "supported: only dense variants are implemented")
    if get("use_bidirectional_attention") == "all":
        raise NotImplementedError("use_bidirectional_attention='all' is not supported (causal LM only)")
    if flag("attention_bias", get("attention_bias")):
        raise NotImplementedError("attention_bias=true is not supported (Gemma 4 has no attention bias)")

    n_layers = int_field(d, "num_hidden_layers", get("num_hidden_layers"))
    layer_types = d.get("layer_types")
    if layer_types is None:  # HF default: 5 sliding then 1 full
        layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    if not isinstance(layer_types, (list, tuple)):
        raise ValueError(f"config field 'layer_types' must be a list of {LAYER_TYPES}, got {short(layer_types)}")
    layer_types = list(layer_types)
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers={n_layers}")
    bad = sorted({short(t) for t in layer_types if not isinstance(t, str) or t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"unsupported layer_types [{join(bad)}]: expected {LAYER_TYPES}")
    if layer_types and layer_types[-1] != FULL:  # HF forces it; so do we (and say so)
        layer_types[-1] = FULL

    head_dim = int_field(d, "head_dim", get("head_dim"))
    kv_heads = int_field(d, "num_key_value_heads", get("num_key_value_heads"))
    k_eq_v = flag("attention_k_eq_v", get("attention_k_eq_v"))
    layer_head_dims = [head_dim] * n_layers
    layer_kv = [kv_heads] * n_layers
    per_layer = d.get("per_layer_config")
    if per_layer is not None and not (isinstance(per_layer, dict)
                                      and all(isinstance(v, dict) for v in per_layer.values())):
        raise ValueError(f"config field 'per_layer_config' must map layer indices to dicts, got {short(per_layer)}")
    if per_layer and len(per_layer) > n_layers:
        raise ValueError(f"config field 'per_layer_config' has {len(per_layer)} entries but there are "
                         f"{n_layers} layers")
    if per_layer:  # HF >= 5.24 serialises the full-layer overrides here
        for key, over in per_layer.items():
            try:
                i = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"per_layer_config key {short(key)} is not a layer index") from None
            if not 0 <= i < n_layers:
                raise ValueError(f"per_layer_config names layer {i}, but there are {n_layers} layers")
            unknown = sorted(short(k) for k in set(over) - set(_PER_LAYER_KEYS))
            if unknown:
                raise NotImplementedError(f"per_layer_config[{i}] overrides [{join(unknown)}]; only "
                                          f"{_PER_LAYER_KEYS} are supported")
            for k, out in (("head_dim", layer_head_dims), ("num_key_value_heads", layer_kv)):
                if k in over:
                    out[i] = number(f"per_layer_config.{i}.{k}", over[k])
    else:  # Google / mlx-lm style: global_head_dim and num_global_key_value_heads
        g_dim = get("global_head_dim")
        g_kv = get("num_global_key_value_heads") if k_eq_v else None
        for i, t in enumerate(layer_types):
            if t == FULL:
                layer_head_dims[i] = number("global_head_dim", g_dim)
                if g_kv is not None:
                    layer_kv[i] = number("num_global_key_value_heads", g_kv)

    rope = d.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config field 'rope_parameters' must be a dict, got {short(rope)}")
    if rope and not any(t in rope for t in LAYER_TYPES):
        raise ValueError(f"rope_parameters must map layer types {LAYER_TYPES} to their RoPE; got keys "
                         f"{short(list(rope))}")
    ropes = {t: _rope(t, rope.get(t) or _DEFAULT_ROPE[t]) for t in LAYER_TYPES}

    softcap = get("final_logit_softcapping")
    vocab = int_field(d, "vocab_size", get("vocab_size"))
    return dict(
        vocab_size=vocab,
        hidden_size=int_field(d, "hidden_size", get("hidden_size")),
        intermediate_size=int_field(d, "intermediate_size", get("intermediate_size")),
        num_hidden_layers=n_layers,
        num_attention_heads=int_field(d, "num_attention_heads", get("num_attention_heads")),
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        layer_types=tuple(layer_types),
        layer_head_dims=tuple(layer_head_dims),
        layer_kv_heads=tuple(layer_kv),
        sliding_window=int_field(d, "sliding_window", get("sliding_window")),
        rope_sliding=ropes[SLIDING],
        rope_full=ropes[FULL],
        rms_norm_eps=number("rms_norm_eps", get("rms_norm_eps")),
        hidden_activation=choice("hidden_activation", get("hidden_activation") or d.get("hidden_act")
                                 or "gelu_pytorch_tanh", ACTIVATIONS),
        final_logit_softcapping=None if softcap is None else number("final_logit_softcapping", softcap),
        tie_word_embeddings=flag("tie_word_embeddings", get("tie_word_embeddings")),
        attention_k_eq_v=k_eq_v,
        num_kv_shared_layers=int_field(d, "num_kv_shared_layers", get("num_kv_shared_layers")),
        hidden_size_per_layer_input=number("hidden_size_per_layer_input", get("hidden_size_per_layer_input") or 0),
        vocab_size_per_layer_input=number("vocab_size_per_layer_input", get("vocab_size_per_layer_input") or 0),
        use_double_wide_mlp=flag("use_double_wide_mlp", get("use_double_wide_mlp")),
        model_type=mt,
        eos_token_ids=eos_ids(d.get("eos_token_id"), vocab),
        max_position_embeddings=(None if d.get("max_position_embeddings") is None
                                 else number("max_position_embeddings", d["max_position_embeddings"])),
    )


def _rope(layer_type: str, p: dict) -> RopeConfig:
    """`rope_parameters[layer_type]`: Gemma 4's two kinds, the proportional one's two extra fields."""
    where = f"rope_parameters.{layer_type}"
    if not isinstance(p, dict):
        raise ValueError(f"{where} must be a dict, got {short(p)}")
    rt = choice(f"{where}.rope_type", p.get("rope_type", p.get("type", "default")), ROPE_TYPES)
    if "rope_theta" not in p:
        raise ValueError(f"{where} has no rope_theta")
    prop = rt == "proportional"  # only "proportional" reads these two
    return RopeConfig(rope_type=rt, theta=number(f"{where}.rope_theta", p["rope_theta"]),
                      partial_rotary_factor=number(f"{where}.partial_rotary_factor",
                                                   p.get("partial_rotary_factor", 1.0)) if prop else 1.0,
                      factor=number(f"{where}.factor", p.get("factor", 1.0)) if prop else 1.0)


def rope_dict(r: RopeConfig) -> dict:
    """A RoPE as config.json's `rope_parameters` entry of its layer type."""
    d = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "linear":
        d["factor"] = r.factor
    if r.rope_type == "proportional":
        d["partial_rotary_factor"] = r.partial_rotary_factor
        if r.factor != 1.0:
            d["factor"] = r.factor
    return d


def to_dict(cfg) -> dict[str, Any]:
    """A gemma4_text-style config.json dict that both HF (per_layer_config) and readers of
    global_head_dim / num_global_key_value_heads parse back to this config."""
    full = [i for i, t in enumerate(cfg.layer_types) if t == FULL]
    per_layer = {}
    for i in range(cfg.num_hidden_layers):
        over = {}
        if cfg.layer_head_dims[i] != cfg.head_dim:
            over["head_dim"] = cfg.layer_head_dims[i]
        if cfg.layer_kv_heads[i] != cfg.num_key_value_heads:
            over["num_key_value_heads"] = cfg.layer_kv_heads[i]
        if over:
            per_layer[str(i)] = over
    g_kv = {cfg.layer_kv_heads[i] for i in full}
    d = dict(
        model_type=cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        global_head_dim=cfg.layer_head_dims[full[0]] if full else cfg.head_dim,
        num_global_key_value_heads=(g_kv.pop() if len(g_kv) == 1 else None) if cfg.attention_k_eq_v else None,
        layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
        rope_parameters={SLIDING: rope_dict(cfg.rope_sliding), FULL: rope_dict(cfg.rope_full)},
        rms_norm_eps=cfg.rms_norm_eps, hidden_activation=cfg.hidden_activation,
        final_logit_softcapping=cfg.final_logit_softcapping,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_k_eq_v=cfg.attention_k_eq_v,
        num_kv_shared_layers=cfg.num_kv_shared_layers,
        hidden_size_per_layer_input=cfg.hidden_size_per_layer_input,
        vocab_size_per_layer_input=cfg.vocab_size_per_layer_input,
        use_double_wide_mlp=cfg.use_double_wide_mlp, enable_moe_block=False, attention_bias=False,
    )
    if cfg.model_type == "gemma4_unified_text":  # that HF class has no PLE / MoE attributes
        for k in ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block"):
            d.pop(k)
    if per_layer:
        d["per_layer_config"] = per_layer
    if cfg.eos_token_ids:
        d["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
    if cfg.max_position_embeddings is not None:
        d["max_position_embeddings"] = cfg.max_position_embeddings
    return d


# ---- the MTP assistant's config (models/config.py's AssistantConfig) -----------------------------
def assistant_text(d: dict[str, Any]) -> dict[str, Any]:
    """An assistant config dict's `text_config` as a Gemma 4 text config dict for `text_fields`:
    every layer KV-shared (HF's rule for the assistant), no per-layer inputs unless given. ValueError
    for a model_type that is not an assistant's (naming the loader of a target config)."""
    mt = d.get("model_type") if isinstance(d, dict) else None
    if mt not in ASSISTANT_TYPES:
        hint = " (a target config: load it with models.load_target)" if mt in TARGET_TYPES + MULTIMODAL_TYPES else ""
        raise ValueError(f"unsupported assistant model_type={short(mt)}{hint}: expected one of {ASSISTANT_TYPES}")
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"model_type={mt!r} config has no 'text_config' dict")
    text = dict(text)
    text.setdefault("model_type", "gemma4_unified_text" if mt == "gemma4_unified_assistant" else "gemma4_text")
    if not text.get("num_kv_shared_layers"):  # HF: the assistant shares every layer
        text["num_kv_shared_layers"] = text.get("num_hidden_layers", _TEXT_DEFAULTS["num_hidden_layers"])
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        text.setdefault(key, 0)
    return text


def assistant_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The AssistantConfig fields of an assistant config dict outside its `text` (`assistant_text`
    checked its model_type)."""
    mt = d["model_type"]
    default_backbone = 3840 if mt == "gemma4_unified_assistant" else 1536
    return dict(
        backbone_hidden_size=int_field(d, "backbone_hidden_size", default_backbone),
        use_ordered_embeddings=flag("use_ordered_embeddings", d.get("use_ordered_embeddings", False)),
        num_centroids=int_field(d, "num_centroids", 2048),
        centroid_intermediate_top_k=int_field(d, "centroid_intermediate_top_k", 32),
        tie_word_embeddings=flag("tie_word_embeddings", d.get("tie_word_embeddings", True)),
        model_type=mt,
        draft_vocab_size=int_field(d, "draft_vocab_size", 0),  # jaxspec's trimmed head (AssistantConfig)
    )


def assistant_architecture(model_type: str) -> str:
    """The HF class a saved assistant checkpoint names (its config.json `architectures`)."""
    unified = model_type.startswith("gemma4_unified")
    return "Gemma4UnifiedAssistantForCausalLM" if unified else "Gemma4AssistantForCausalLM"


FAMILY = Family(name="gemma4", model_types=TARGET_TYPES + MULTIMODAL_TYPES, parse=parse, to_dict=to_dict,
                architecture="Gemma4ForCausalLM", assistant_types=ASSISTANT_TYPES)
