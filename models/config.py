"""Model configs parsed from config.json dicts: frozen and hashable, so they ride as static pytree fields.

Which family parses a dict is decided by its `model_type` (models/families.py: Gemma 4 here, Gemma 3
in models/gemma3.py); every family parses into the one `TargetConfig`, whose family fields
(`norm_offset`, `query_pre_attn_scalar`, `value_norm`, `layer_scalar`) say how the shared forward
computes it. Every field is read from the dict; a field that is absent takes the HF transformers
5.24 default of the config class named by `model_type` (mlx-lm's defaults differ, which is why
nothing is assumed).
Every numeric field has a range (FIELD_RANGES) checked as it is parsed, and again when a config is
built directly: a bad value is one short ValueError line naming the field, the value and the range,
before any weight is read or anything compiles.
"""
from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

TARGET_TYPES = ("gemma4_text", "gemma4_unified_text")
MULTIMODAL_TYPES = ("gemma4", "gemma4_unified")
ASSISTANT_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
ROPE_TYPES = ("default", "proportional", "linear")
_GEMMA4_ROPE_TYPES = ("default", "proportional")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")

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


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric config field may take: [lo, hi] (lo excluded when `lo_open`), integers
    when `integer` (a whole float such as 512.0 counts: some JSON writers emit those)."""

    lo: float
    hi: float
    integer: bool = True
    lo_open: bool = False

    def __contains__(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if self.integer and isinstance(v, float) and not v.is_integer():
            return False
        # int-float comparisons are exact in Python (no overflow for huge ints); NaN compares False
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi

    def __str__(self) -> str:
        kind, fmt = ("an integer", "d") if self.integer else ("a finite number", "g")
        return f"{kind} in {'(' if self.lo_open else '['}{self.lo:{fmt}}, {self.hi:{fmt}}]"


MAX_LAYERS = 4096  # ~40x the deepest Gemma 4 (60): a bound that keeps per-layer work and messages small
_WIDTH, _HEADS, _TOKENS = 1 << 16, 1024, 1 << 24

# The one table of ranges: sizes generous around real Gemma 4 configs, floats bounded so that float32
# stays finite and the model is not degenerate (a softcap that rounds to 0 caps every logit to 0,
# eps <= 0 or a theta / factor <= 0 gives NaN RoPE or norms). Keyed by the field's (last) name.
FIELD_RANGES: dict[str, Range] = {
    "vocab_size": Range(1, _TOKENS),
    "hidden_size": Range(1, _WIDTH),
    "intermediate_size": Range(1, 1 << 18),
    "num_hidden_layers": Range(1, MAX_LAYERS),
    "num_attention_heads": Range(1, _HEADS),
    "num_key_value_heads": Range(1, _HEADS),
    "num_global_key_value_heads": Range(1, _HEADS),
    "head_dim": Range(2, 4096),          # and even (rotate-half RoPE): TargetConfig.validate
    "global_head_dim": Range(2, 4096),
    "sliding_window": Range(1, _TOKENS),
    "max_position_embeddings": Range(1, _TOKENS),
    "num_kv_shared_layers": Range(0, MAX_LAYERS),     # and <= num_hidden_layers
    "hidden_size_per_layer_input": Range(0, _WIDTH),  # 0: no per-layer inputs
    "vocab_size_per_layer_input": Range(0, _TOKENS),
    "eos_token_id": Range(0, _TOKENS - 1),            # and < vocab_size
    "backbone_hidden_size": Range(1, _WIDTH),
    "num_centroids": Range(1, _TOKENS),
    "centroid_intermediate_top_k": Range(1, _TOKENS),  # and <= num_centroids when used
    "rms_norm_eps": Range(1e-12, 1.0, integer=False),
    "final_logit_softcapping": Range(1e-3, 1e6, integer=False),  # null / absent: no cap
    "rope_theta": Range(1.0, 1e12, integer=False),
    "partial_rotary_factor": Range(0.0, 1.0, integer=False, lo_open=True),
    "factor": Range(1e-3, 1e6, integer=False),
    "query_pre_attn_scalar": Range(1e-6, 1e12, integer=False),  # null / absent: attention scale 1.0
    "norm_offset": Range(0.0, 1.0, integer=False),
}
MAX_EOS_IDS = 1024
_NULL_MEANS = {"final_logit_softcapping": "no cap", "max_position_embeddings": "not given",
               "query_pre_attn_scalar": "attention scale 1.0"}  # optional fields


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def __post_init__(self):
        _choice("rope_type", self.rope_type, ROPE_TYPES)
        for name, v in (("rope_theta", self.theta), ("partial_rotary_factor", self.partial_rotary_factor),
                        ("factor", self.factor)):
            _number(name, v)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the `model_type`s it reads, how it parses a config.json dict into a
    TargetConfig and writes one back, and the HF class a saved checkpoint names. The registry of
    families is models/families.py."""

    name: str
    model_types: tuple[str, ...]     # config.json model_type values (text configs and their wrappers)
    parse: Any                       # dict -> TargetConfig
    to_dict: Any                     # TargetConfig -> config.json dict
    architecture: str                # `architectures` of a saved checkpoint


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A decoder-only text stack (dense) of a registered family. Per-layer head_dim / kv heads are
    resolved into tuples. The last four fields are the family's numerics (defaults: Gemma 4's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    layer_head_dims: tuple[int, ...]
    layer_kv_heads: tuple[int, ...]
    sliding_window: int
    rope_sliding: RopeConfig
    rope_full: RopeConfig
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False
    model_type: str = "gemma4_text"
    eos_token_ids: tuple[int, ...] = ()          # generate() stops on these by default
    max_position_embeddings: int | None = None   # the context the model was trained for
    norm_offset: float = 0.0                     # every RMSNorm scales by (norm_offset + w)
    query_pre_attn_scalar: float | None = None   # attention scale query_pre_attn_scalar**-0.5 (None: 1.0)
    value_norm: bool = True                      # v is RMSNorm'd without a scale (else left as projected)
    layer_scalar: bool = True                    # each layer's output times its `layer_scalar` buffer

    def __post_init__(self):
        self.validate()

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TargetConfig":
        """Parse a config.json dict of any registered family (models/families.py): Gemma 4
        (gemma4_text / gemma4_unified_text, or gemma4 / gemma4_unified: their `text_config`), Gemma 3
        (gemma3_text, or gemma3's `text_config`). Raises ValueError for other model types,
        NotImplementedError for features not implemented (MoE, ...)."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        from .families import family_of  # the registry imports the family modules, which import this one

        return family_of(d.get("model_type")).parse(d)

    @property
    def family(self) -> Family:
        from .families import family_of

        return family_of(self.model_type)

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax (HF: `query_pre_attn_scalar**-0.5`, or 1.0)."""
        return 1.0 if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    @classmethod
    def _from_gemma4_dict(cls, d: dict[str, Any]) -> "TargetConfig":
        """Gemma 4's parser (models/gemma4.py registers it)."""
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
            return cls._from_text_dict(text, outer_type=mt)
        return cls._from_text_dict(d, outer_type=mt)  # one of TARGET_TYPES (families.family_of checked)

    @classmethod
    def _from_text_dict(cls, d: dict[str, Any], outer_type: str) -> "TargetConfig":
        mt = d.get("model_type", "gemma4_text")
        if mt not in TARGET_TYPES:
            raise ValueError(f"unsupported text_config model_type={_short(mt)}: expected one of {TARGET_TYPES}")
        defaults = _UNIFIED_TEXT_DEFAULTS if mt == "gemma4_unified_text" else _TEXT_DEFAULTS

        def get(key):
            v = d.get(key, defaults.get(key))
            return defaults.get(key) if v is None and key in ("hidden_size_per_layer_input",
                                                              "vocab_size_per_layer_input") else v

        if _bool("enable_moe_block", get("enable_moe_block")):
            raise NotImplementedError("Gemma 4 MoE configs (enable_moe_block=true, e.g. 26B-A4B) are not "
                                      "supported: only dense variants are implemented")
        if get("use_bidirectional_attention") == "all":
            raise NotImplementedError("use_bidirectional_attention='all' is not supported (causal LM only)")
        if _bool("attention_bias", get("attention_bias")):
            raise NotImplementedError("attention_bias=true is not supported (Gemma 4 has no attention bias)")

        n_layers = _int(d, "num_hidden_layers", get("num_hidden_layers"))
        layer_types = d.get("layer_types")
        if layer_types is None:  # HF default: 5 sliding then 1 full
            layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise ValueError(f"config field 'layer_types' must be a list of {LAYER_TYPES}, got {_short(layer_types)}")
        layer_types = list(layer_types)
        if len(layer_types) != n_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries but num_hidden_layers={n_layers}")
        bad = sorted({_short(t) for t in layer_types if not isinstance(t, str) or t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"unsupported layer_types [{_join(bad)}]: expected {LAYER_TYPES}")
        if layer_types and layer_types[-1] != FULL:  # HF forces it; so do we (and say so)
            layer_types[-1] = FULL

        head_dim = _int(d, "head_dim", get("head_dim"))
        kv_heads = _int(d, "num_key_value_heads", get("num_key_value_heads"))
        k_eq_v = _bool("attention_k_eq_v", get("attention_k_eq_v"))
        layer_head_dims = [head_dim] * n_layers
        layer_kv = [kv_heads] * n_layers
        per_layer = d.get("per_layer_config")
        if per_layer is not None and not (isinstance(per_layer, dict)
                                          and all(isinstance(v, dict) for v in per_layer.values())):
            raise ValueError(f"config field 'per_layer_config' must map layer indices to dicts, got {_short(per_layer)}")
        if per_layer and len(per_layer) > n_layers:
            raise ValueError(f"config field 'per_layer_config' has {len(per_layer)} entries but there are "
                             f"{n_layers} layers")
        if per_layer:  # HF >= 5.24 serialises the full-layer overrides here
            for key, over in per_layer.items():
                try:
                    i = int(key)
                except (TypeError, ValueError):
                    raise ValueError(f"per_layer_config key {_short(key)} is not a layer index") from None
                if not 0 <= i < n_layers:
                    raise ValueError(f"per_layer_config names layer {i}, but there are {n_layers} layers")
                unknown = sorted(_short(k) for k in set(over) - set(_PER_LAYER_KEYS))
                if unknown:
                    raise NotImplementedError(f"per_layer_config[{i}] overrides [{_join(unknown)}]; only "
                                              f"{_PER_LAYER_KEYS} are supported")
                for k, out in (("head_dim", layer_head_dims), ("num_key_value_heads", layer_kv)):
                    if k in over:
                        out[i] = _number(f"per_layer_config.{i}.{k}", over[k])
        else:  # Google / mlx-lm style: global_head_dim and num_global_key_value_heads
            g_dim = get("global_head_dim")
            g_kv = get("num_global_key_value_heads") if k_eq_v else None
            for i, t in enumerate(layer_types):
                if t == FULL:
                    layer_head_dims[i] = _number("global_head_dim", g_dim)
                    if g_kv is not None:
                        layer_kv[i] = _number("num_global_key_value_heads", g_kv)

        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"config field 'rope_parameters' must be a dict, got {_short(rope)}")
        if rope and not any(t in rope for t in LAYER_TYPES):
            raise ValueError(f"rope_parameters must map layer types {LAYER_TYPES} to their RoPE; got keys "
                             f"{_short(list(rope))}")
        ropes = {t: _rope(t, rope.get(t) or _DEFAULT_ROPE[t]) for t in LAYER_TYPES}

        softcap = get("final_logit_softcapping")
        vocab = _int(d, "vocab_size", get("vocab_size"))
        return cls(
            vocab_size=vocab,
            hidden_size=_int(d, "hidden_size", get("hidden_size")),
            intermediate_size=_int(d, "intermediate_size", get("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=_int(d, "num_attention_heads", get("num_attention_heads")),
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            layer_types=tuple(layer_types),
            layer_head_dims=tuple(layer_head_dims),
            layer_kv_heads=tuple(layer_kv),
            sliding_window=_int(d, "sliding_window", get("sliding_window")),
            rope_sliding=ropes[SLIDING],
            rope_full=ropes[FULL],
            rms_norm_eps=_number("rms_norm_eps", get("rms_norm_eps")),
            hidden_activation=_choice("hidden_activation", get("hidden_activation") or d.get("hidden_act")
                                      or "gelu_pytorch_tanh", ACTIVATIONS),
            final_logit_softcapping=None if softcap is None else _number("final_logit_softcapping", softcap),
            tie_word_embeddings=_bool("tie_word_embeddings", get("tie_word_embeddings")),
            attention_k_eq_v=k_eq_v,
            num_kv_shared_layers=_int(d, "num_kv_shared_layers", get("num_kv_shared_layers")),
            hidden_size_per_layer_input=_int({}, "hidden_size_per_layer_input", get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=_int({}, "vocab_size_per_layer_input", get("vocab_size_per_layer_input") or 0),
            use_double_wide_mlp=_bool("use_double_wide_mlp", get("use_double_wide_mlp")),
            model_type=mt,
            eos_token_ids=_eos_ids(d.get("eos_token_id"), vocab),
            max_position_embeddings=(None if d.get("max_position_embeddings") is None
                                     else _number("max_position_embeddings", d["max_position_embeddings"])),
        )

    def to_dict(self) -> dict[str, Any]:
        """A config.json dict of this config's family that `from_dict` parses back to it."""
        return self.family.to_dict(self)

    def _gemma4_dict(self) -> dict[str, Any]:
        """A gemma4_text-style config.json dict that both HF (per_layer_config) and readers of
        global_head_dim / num_global_key_value_heads parse back to this config."""
        full = [i for i, t in enumerate(self.layer_types) if t == FULL]
        per_layer = {}
        for i in range(self.num_hidden_layers):
            over = {}
            if self.layer_head_dims[i] != self.head_dim:
                over["head_dim"] = self.layer_head_dims[i]
            if self.layer_kv_heads[i] != self.num_key_value_heads:
                over["num_key_value_heads"] = self.layer_kv_heads[i]
            if over:
                per_layer[str(i)] = over
        g_kv = {self.layer_kv_heads[i] for i in full}
        d = dict(
            model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            global_head_dim=self.layer_head_dims[full[0]] if full else self.head_dim,
            num_global_key_value_heads=(g_kv.pop() if len(g_kv) == 1 else None) if self.attention_k_eq_v else None,
            layer_types=list(self.layer_types), sliding_window=self.sliding_window,
            rope_parameters={SLIDING: _rope_dict(self.rope_sliding), FULL: _rope_dict(self.rope_full)},
            rms_norm_eps=self.rms_norm_eps, hidden_activation=self.hidden_activation,
            final_logit_softcapping=self.final_logit_softcapping,
            tie_word_embeddings=self.tie_word_embeddings, attention_k_eq_v=self.attention_k_eq_v,
            num_kv_shared_layers=self.num_kv_shared_layers,
            hidden_size_per_layer_input=self.hidden_size_per_layer_input,
            vocab_size_per_layer_input=self.vocab_size_per_layer_input,
            use_double_wide_mlp=self.use_double_wide_mlp, enable_moe_block=False, attention_bias=False,
        )
        if self.model_type == "gemma4_unified_text":  # that HF class has no PLE / MoE attributes
            for k in ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block"):
                d.pop(k)
        if per_layer:
            d["per_layer_config"] = per_layer
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        if self.max_position_embeddings is not None:
            d["max_position_embeddings"] = self.max_position_embeddings
        return d

    # ---- checks --------------------------------------------------------------------------------
    def validate(self) -> None:
        for f in dataclasses.fields(self):  # every numeric field against its range, sizes first
            if f.name in FIELD_RANGES:
                v = getattr(self, f.name)
                if not (v is None and f.name in _NULL_MEANS):  # the optional fields
                    _number(f.name, v)
        for name in ("rope_sliding", "rope_full"):
            if not isinstance(getattr(self, name), RopeConfig):
                raise ValueError(f"{name} must be a RopeConfig, got {_short(getattr(self, name))}")
        _eos_ids(self.eos_token_ids, self.vocab_size)
        for name in ("value_norm", "layer_scalar"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {_short(getattr(self, name))}")
        n = self.num_hidden_layers
        for name in ("layer_types", "layer_head_dims", "layer_kv_heads"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, expected {n}")
        bad = [t for t in self.layer_types if not isinstance(t, str) or t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types has {len(bad)} unsupported entries (first {_short(bad[0])}): "
                             f"expected {LAYER_TYPES}")
        for i in range(n):
            kv = _number(f"layer_kv_heads[{i}]", self.layer_kv_heads[i], "num_key_value_heads")
            d = _number(f"layer_head_dims[{i}]", self.layer_head_dims[i], "head_dim")
            if self.num_attention_heads % kv:
                raise ValueError(f"layer {i}: num_attention_heads={self.num_attention_heads} is not a "
                                 f"multiple of its num_key_value_heads={kv}")
            if d % 2:
                raise ValueError(f"layer {i}: head_dim={d} must be even (rotate-half RoPE)")
        _choice("hidden_activation", self.hidden_activation, ACTIVATIONS)
        if self.num_kv_shared_layers > n:
            raise ValueError(f"config field 'num_kv_shared_layers'={self.num_kv_shared_layers} must be an integer "
                             f"in [0, num_hidden_layers={n}]")
        if 0 < self.num_kv_shared_layers < n:
            first = n - self.num_kv_shared_layers
            missing = set(self.layer_types[first:]) - set(self.layer_types[:first])
            if missing:
                raise ValueError(f"KV-shared layers of type {sorted(missing)} have no earlier non-shared "
                                 "layer of the same type to read K/V from")
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < 1:
            raise ValueError("hidden_size_per_layer_input > 0 needs vocab_size_per_layer_input > 0")

    # ---- per-layer structure -----------------------------------------------------------------------
    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING

    def kv_shared(self, i: int) -> bool:
        """True for layers without K/V projections (they read another layer's K/V)."""
        return i >= self.num_hidden_layers - self.num_kv_shared_layers

    def k_eq_v(self, i: int) -> bool:
        return self.attention_k_eq_v and not self.is_sliding(i)

    def store_layer(self, layer_type: str) -> int | None:
        """The last non-shared layer of `layer_type`: the one KV-shared layers and the assistant read."""
        first = self.num_hidden_layers - self.num_kv_shared_layers
        idx = [i for i in range(first) if self.layer_types[i] == layer_type]
        return idx[-1] if idx else None

    def kv_source(self, i: int) -> int:
        return self.store_layer(self.layer_types[i]) if self.kv_shared(i) else i

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """Layers that own K/V, in order: KVCache.k[j] belongs to layer cache_layers[j]."""
        return tuple(i for i in range(self.num_hidden_layers) if not self.kv_shared(i))

    def cache_slot(self, i: int) -> int:
        return self.cache_layers.index(self.kv_source(i))

    def mlp_width(self, i: int) -> int:
        return self.intermediate_size * (2 if self.use_double_wide_mlp and self.kv_shared(i) else 1)

    def rope(self, i: int) -> RopeConfig:
        return self.rope_sliding if self.is_sliding(i) else self.rope_full

    @property
    def has_per_layer_inputs(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """A Gemma 4 MTP assistant: its own text stack (every layer KV-shared, Q-only) plus the top level."""

    text: TargetConfig
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True
    model_type: str = "gemma4_assistant"

    def __post_init__(self):
        t = self.text
        if t.has_per_layer_inputs:
            raise ValueError(f"assistant text_config.hidden_size_per_layer_input must be 0, got "
                             f"{t.hidden_size_per_layer_input}")
        if t.use_double_wide_mlp:
            raise ValueError("assistant text_config.use_double_wide_mlp must be false")
        if t.num_kv_shared_layers != t.num_hidden_layers:
            raise ValueError(f"every assistant layer must be KV-shared: num_kv_shared_layers="
                             f"{t.num_kv_shared_layers}, num_hidden_layers={t.num_hidden_layers}")
        for name in ("backbone_hidden_size", "num_centroids", "centroid_intermediate_top_k"):
            _number(name, getattr(self, name))
        if self.use_ordered_embeddings:
            if t.vocab_size % self.num_centroids:
                raise ValueError(f"vocab_size={t.vocab_size} is not a multiple of num_centroids={self.num_centroids}")
            if not 1 <= self.centroid_intermediate_top_k <= self.num_centroids:
                raise ValueError(f"centroid_intermediate_top_k={self.centroid_intermediate_top_k} not in "
                                 f"[1, num_centroids={self.num_centroids}]")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AssistantConfig":
        mt = d.get("model_type") if isinstance(d, dict) else None
        if mt not in ASSISTANT_TYPES:
            hint = " (a target config: load it with models.load_target)" if mt in TARGET_TYPES + MULTIMODAL_TYPES else ""
            raise ValueError(f"unsupported assistant model_type={_short(mt)}{hint}: expected one of {ASSISTANT_TYPES}")
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"model_type={mt!r} config has no 'text_config' dict")
        text = dict(text)
        text.setdefault("model_type", "gemma4_unified_text" if mt == "gemma4_unified_assistant" else "gemma4_text")
        if not text.get("num_kv_shared_layers"):  # HF: the assistant shares every layer
            text["num_kv_shared_layers"] = text.get("num_hidden_layers", _TEXT_DEFAULTS["num_hidden_layers"])
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            text.setdefault(key, 0)
        tcfg = TargetConfig._from_text_dict(text, outer_type=mt)
        default_backbone = 3840 if mt == "gemma4_unified_assistant" else 1536
        return cls(
            text=tcfg,
            backbone_hidden_size=_int(d, "backbone_hidden_size", default_backbone),
            use_ordered_embeddings=_bool("use_ordered_embeddings", d.get("use_ordered_embeddings", False)),
            num_centroids=_int(d, "num_centroids", 2048),
            centroid_intermediate_top_k=_int(d, "centroid_intermediate_top_k", 32),
            tie_word_embeddings=_bool("tie_word_embeddings", d.get("tie_word_embeddings", True)),
            model_type=mt,
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(model_type=self.model_type, text_config=self.text.to_dict(),
                    backbone_hidden_size=self.backbone_hidden_size,
                    use_ordered_embeddings=self.use_ordered_embeddings, num_centroids=self.num_centroids,
                    centroid_intermediate_top_k=self.centroid_intermediate_top_k,
                    tie_word_embeddings=self.tie_word_embeddings)

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size


def check_fit(assistant: AssistantConfig, target: TargetConfig) -> None:
    """Raise ValueError (naming the mismatches, the first few in full) unless `assistant` can draft for `target`;
    TypeError when they are not an AssistantConfig and a TargetConfig (e.g. swapped)."""
    for name, value, kind in (("assistant", assistant, AssistantConfig), ("target", target, TargetConfig)):
        if not isinstance(value, kind):
            raise TypeError(f"check_fit(assistant, target): {name} must be a{'n' if kind is AssistantConfig else ''} "
                            f"{kind.__name__}, got {type(value).__name__}")
    a = assistant.text
    problems = []
    if assistant.backbone_hidden_size != target.hidden_size:
        problems.append(f"assistant backbone_hidden_size={assistant.backbone_hidden_size} != target "
                        f"hidden_size={target.hidden_size}")
    if a.vocab_size != target.vocab_size:
        problems.append(f"assistant vocab_size={a.vocab_size} != target vocab_size={target.vocab_size}")
    sources = {t: target.store_layer(t) for t in LAYER_TYPES}  # once, not per assistant layer
    for i, t in enumerate(a.layer_types):
        src = sources[t]
        if src is None:
            problems.append(f"assistant layer {i} is {t} but the target has no non-shared {t} layer")
            continue
        if a.layer_head_dims[i] != target.layer_head_dims[src]:
            problems.append(f"assistant layer {i} ({t}) head_dim={a.layer_head_dims[i]} != target layer "
                            f"{src} head_dim={target.layer_head_dims[src]}")
        kv = target.layer_kv_heads[src]
        if a.layer_kv_heads[i] != kv:
            problems.append(f"assistant layer {i} ({t}) num_key_value_heads={a.layer_kv_heads[i]} != target "
                            f"layer {src} num_key_value_heads={kv}")
        if a.num_attention_heads % kv:
            problems.append(f"assistant num_attention_heads={a.num_attention_heads} is not a multiple of the "
                            f"target layer {src} num_key_value_heads={kv}")
    if problems:
        raise ValueError("assistant does not fit the target: " + _join(problems, sep="; "))


# ---- the one rule per kind of value ------------------------------------------------------------------
class _Brief(reprlib.Repr):
    """repr() cut short: a few items of a container, the start of a string, the size of a huge int
    (whose repr() Python refuses past 4300 digits), so a message never grows with the input."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 2, 40, 40, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4

    def repr_int(self, x, level):
        return f"<{x.bit_length()}-bit integer>" if x.bit_length() > 128 else super().repr_int(x, level)

    def repr_dict(self, x, level):  # reprlib sorts every key first: O(n log n), and fails on mixed types
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in list(x.items())[:self.maxdict]]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"


_BRIEF = _Brief()


def _short(v) -> str:
    """A value as shown in an error: its repr, at most ~80 characters."""
    s = _BRIEF.repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _join(items, sep=", ", budget=150) -> str:
    """`items` joined while they fit in `budget` characters, then how many were left out."""
    out, used = [], 0
    for j, it in enumerate(items):
        if out and used + len(it) > budget:
            return sep.join(out) + f"{sep}... and {len(items) - j} more"
        out.append(it)
        used += len(it) + len(sep)
    return sep.join(out)


def _number(path: str, v, key: str | None = None):
    """The one rule for a numeric config value: the type and range of FIELD_RANGES[key] (default: the
    path's last name). Returns it as int or float; ValueError naming path, value and range."""
    r = FIELD_RANGES[key or path.rsplit(".", 1)[-1]]
    if v is None:
        raise ValueError(f"config field {path!r} is missing: must be {r}")
    if v not in r:
        null = _NULL_MEANS.get(path)
        raise ValueError(f"config field {path!r}={_short(v)} must be {r}" + (f" (or null: {null})" if null else ""))
    return int(v) if r.integer else float(v)


def _int(d, key, default):
    return _number(key, d.get(key, default))


def _choice(path: str, v, options: tuple[str, ...]) -> str:
    """A string field that must be one of `options` (NotImplementedError: the others are formats or
    features this implementation does not have)."""
    if not isinstance(v, str) or v not in options:
        raise NotImplementedError(f"config field {path!r}={_short(v)} is not supported: expected one of {options}")
    return v


def _bool(key, v) -> bool:
    """A JSON flag: true / false (null and 0 / 1 accepted); a string such as "false" is an error."""
    if v is None or isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise ValueError(f"config field {key!r}={_short(v)} must be true or false")


def _eos_ids(v, vocab_size: int) -> tuple[int, ...]:
    """config.json's eos_token_id: absent, a token id, or a list of at most MAX_EOS_IDS of them."""
    if v is None:
        return ()
    ids = v if isinstance(v, (list, tuple)) else [v]
    r = FIELD_RANGES["eos_token_id"]
    if len(ids) > MAX_EOS_IDS or not all(t in r and isinstance(t, int) and t < vocab_size for t in ids):
        raise ValueError(f"config field 'eos_token_id'={_short(v)} must be a token id in [0, vocab_size="
                         f"{vocab_size}) or a list of at most {MAX_EOS_IDS} of them")
    return tuple(ids)


def _rope(layer_type: str, p: dict) -> RopeConfig:
    where = f"rope_parameters.{layer_type}"
    if not isinstance(p, dict):
        raise ValueError(f"{where} must be a dict, got {_short(p)}")
    rt = _choice(f"{where}.rope_type", p.get("rope_type", p.get("type", "default")), _GEMMA4_ROPE_TYPES)
    if "rope_theta" not in p:
        raise ValueError(f"{where} has no rope_theta")
    prop = rt == "proportional"  # only "proportional" reads these two
    return RopeConfig(rope_type=rt, theta=_number(f"{where}.rope_theta", p["rope_theta"]),
                      partial_rotary_factor=_number(f"{where}.partial_rotary_factor",
                                                    p.get("partial_rotary_factor", 1.0)) if prop else 1.0,
                      factor=_number(f"{where}.factor", p.get("factor", 1.0)) if prop else 1.0)


def quantization_format(d: dict) -> dict | None:
    """The MLX `quantization` section of a config.json dict (else an HF `quantization_config` that has
    `bits`), checked as config is read: a dict whose `bits` / `group_size` (global, and in each
    per-module override dict) are supported integers and whose `mode` is "affine". None when absent.
    ValueError naming the field, the value and the allowed set; NotImplementedError for another
    quantization method or mode."""
    from jaxspec.kernels.quant import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

    name, q = "quantization", d.get("quantization")
    if q is None:
        name, q = "quantization_config", d.get("quantization_config")
        if isinstance(q, dict) and "bits" not in q:
            raise NotImplementedError(f"{name} {_short(q.get('quant_method', q))} is not the MLX affine "
                                      "format (expected 'bits' and 'group_size')")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"config field {name!r} must be a dict, got {_short(q)}")
    if q.get("mode", "affine") != "affine":
        raise NotImplementedError(f"config field '{name}.mode'={_short(q.get('mode'))} is not supported "
                                  "(only 'affine')")
    allowed = {"bits": SUPPORTED_BITS, "group_size": SUPPORTED_GROUP_SIZES}
    for where, sec in [(name, q)] + [(f"{name}.{k}", v) for k, v in q.items() if isinstance(v, dict)]:
        for key, ok in allowed.items():
            v = sec.get(key)
            if v is not None and not (v in Range(min(ok), max(ok)) and int(v) in ok):
                path = f"{where}.{key}" if len(where) <= 80 else f"{where[:60]}....{key}"  # module names are the user's
                raise ValueError(f"config field {path!r}={_short(v)} must be one of {ok}")
    return q


def _rope_dict(r: RopeConfig) -> dict:
    d = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "linear":
        d["factor"] = r.factor
    if r.rope_type == "proportional":
        d["partial_rotary_factor"] = r.partial_rotary_factor
        if r.factor != 1.0:
            d["factor"] = r.factor
    return d
