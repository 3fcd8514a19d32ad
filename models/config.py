"""Model configs parsed from config.json dicts: frozen and hashable, so they ride as static pytree fields.

`TargetConfig.from_dict` hands a dict to the family that reads its `model_type` (the registry
models/families.py: Gemma 4 in models/gemma4.py, Gemma 3 in models/gemma3.py), whose parser gives
the fields of the one `TargetConfig`; its family fields (`norm_offset`, `query_pre_attn_scalar`,
`value_norm`, `layer_scalar`) say how the shared forward computes it. `AssistantConfig` is Gemma 4's
MTP assistant (models/gemma4.py reads its dict). Every numeric field is checked against its range
(models/config_fields.py) as it is parsed, and again when a config is built directly: a bad value
is one short ValueError line naming the field, the value and the range, before any weight is read
or anything compiles.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from . import gemma4
from .config_fields import FULL  # noqa: F401  (with SLIDING and RopeConfig: the names a config is read with)
from .config_fields import (ACTIVATIONS, FIELD_RANGES, LAYER_TYPES, NULL_MEANS, SLIDING, Range, RopeConfig, choice,
                            eos_ids, join, number, short)
from .families import family_of
from .family_spec import Family


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
        return cls(**family_of(d.get("model_type")).parse(d))

    @property
    def family(self) -> Family:
        return family_of(self.model_type)

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax (HF: `query_pre_attn_scalar**-0.5`, or 1.0)."""
        return 1.0 if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    def to_dict(self) -> dict[str, Any]:
        """A config.json dict of this config's family that `from_dict` parses back to it."""
        return self.family.to_dict(self)

    # ---- checks --------------------------------------------------------------------------------
    def validate(self) -> None:
        for f in dataclasses.fields(self):  # every numeric field against its range, sizes first
            if f.name in FIELD_RANGES:
                v = getattr(self, f.name)
                if not (v is None and f.name in NULL_MEANS):  # the optional fields
                    number(f.name, v)
        for name in ("rope_sliding", "rope_full"):
            if not isinstance(getattr(self, name), RopeConfig):
                raise ValueError(f"{name} must be a RopeConfig, got {short(getattr(self, name))}")
        eos_ids(self.eos_token_ids, self.vocab_size)
        for name in ("value_norm", "layer_scalar"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {short(getattr(self, name))}")
        n = self.num_hidden_layers
        for name in ("layer_types", "layer_head_dims", "layer_kv_heads"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, expected {n}")
        bad = [t for t in self.layer_types if not isinstance(t, str) or t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types has {len(bad)} unsupported entries (first {short(bad[0])}): "
                             f"expected {LAYER_TYPES}")
        for i in range(n):
            kv = number(f"layer_kv_heads[{i}]", self.layer_kv_heads[i], "num_key_value_heads")
            d = number(f"layer_head_dims[{i}]", self.layer_head_dims[i], "head_dim")
            if self.num_attention_heads % kv:
                raise ValueError(f"layer {i}: num_attention_heads={self.num_attention_heads} is not a "
                                 f"multiple of its num_key_value_heads={kv}")
            if d % 2:
                raise ValueError(f"layer {i}: head_dim={d} must be even (rotate-half RoPE)")
        choice("hidden_activation", self.hidden_activation, ACTIVATIONS)
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
    # jaxspec's trimmed draft vocabulary (FR-Spec / VocabTrim): > 0 means the head scores only these
    # many tokens (params "draft_vocab", the ids, and "draft_head", their head rows); 0: every token.
    draft_vocab_size: int = 0

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
        for name in ("backbone_hidden_size", "num_centroids", "centroid_intermediate_top_k", "draft_vocab_size"):
            number(name, getattr(self, name))
        if self.draft_vocab_size:
            if self.draft_vocab_size > t.vocab_size:
                raise ValueError(f"draft_vocab_size={self.draft_vocab_size} > vocab_size={t.vocab_size}")
            if self.use_ordered_embeddings:  # two ways of cutting the head's work: one at a time
                raise ValueError("draft_vocab_size and use_ordered_embeddings cannot both be set")
        if self.use_ordered_embeddings:
            if t.vocab_size % self.num_centroids:
                raise ValueError(f"vocab_size={t.vocab_size} is not a multiple of num_centroids={self.num_centroids}")
            if not 1 <= self.centroid_intermediate_top_k <= self.num_centroids:
                raise ValueError(f"centroid_intermediate_top_k={self.centroid_intermediate_top_k} not in "
                                 f"[1, num_centroids={self.num_centroids}]")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AssistantConfig":
        """Parse a gemma4_assistant / gemma4_unified_assistant config.json dict (models/gemma4.py)."""
        text = TargetConfig(**gemma4.text_fields(gemma4.assistant_text(d)))
        return cls(text=text, **gemma4.assistant_fields(d))

    def to_dict(self) -> dict[str, Any]:
        return dict(model_type=self.model_type, text_config=self.text.to_dict(),
                    backbone_hidden_size=self.backbone_hidden_size,
                    use_ordered_embeddings=self.use_ordered_embeddings, num_centroids=self.num_centroids,
                    centroid_intermediate_top_k=self.centroid_intermediate_top_k,
                    tie_word_embeddings=self.tie_word_embeddings,
                    # absent when 0, so configs without a trimmed head read as they always did
                    **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}))

    @property
    def architecture(self) -> str:
        """The HF class a saved checkpoint of this assistant names."""
        return gemma4.assistant_architecture(self.model_type)

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
        raise ValueError("assistant does not fit the target: " + join(problems, sep="; "))


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
            raise NotImplementedError(f"{name} {short(q.get('quant_method', q))} is not the MLX affine "
                                      "format (expected 'bits' and 'group_size')")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"config field {name!r} must be a dict, got {short(q)}")
    if q.get("mode", "affine") != "affine":
        raise NotImplementedError(f"config field '{name}.mode'={short(q.get('mode'))} is not supported "
                                  "(only 'affine')")
    allowed = {"bits": SUPPORTED_BITS, "group_size": SUPPORTED_GROUP_SIZES}
    for where, sec in [(name, q)] + [(f"{name}.{k}", v) for k, v in q.items() if isinstance(v, dict)]:
        for key, ok in allowed.items():
            v = sec.get(key)
            if v is not None and not (v in Range(min(ok), max(ok)) and int(v) in ok):
                path = f"{where}.{key}" if len(where) <= 80 else f"{where[:60]}....{key}"  # module names are the user's
                raise ValueError(f"config field {path!r}={short(v)} must be one of {ok}")
    return q

