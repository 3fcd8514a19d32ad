"""What a config field may hold, and the one rule per kind of value.

The shared vocabulary of every family's parser (models/gemma4.py, models/gemma3.py) and of
TargetConfig's own checks (models/config.py): the layer types, the activations and RoPE kinds the
forward computes, `RopeConfig`, and the range of every numeric field (FIELD_RANGES), checked as a
field is parsed and again when a config is built directly: a bad value is one short ValueError line
naming the field, the value and the range, before any weight is read or anything compiles. A
message shows a value through `short`, so it never grows with the input.

Nothing of the package is imported here: the family modules and config.py all build on it.
"""
from __future__ import annotations

import dataclasses
import reprlib

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional", "linear")  # what models/layers.py computes (a family may take fewer)
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")


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
    "draft_vocab_size": Range(0, _TOKENS),            # 0: the head covers the vocabulary; <= vocab_size
    "rms_norm_eps": Range(1e-12, 1.0, integer=False),
    "final_logit_softcapping": Range(1e-3, 1e6, integer=False),  # null / absent: no cap
    "rope_theta": Range(1.0, 1e12, integer=False),
    "partial_rotary_factor": Range(0.0, 1.0, integer=False, lo_open=True),
    "factor": Range(1e-3, 1e6, integer=False),
    "query_pre_attn_scalar": Range(1e-6, 1e12, integer=False),  # null / absent: attention scale 1.0
    "norm_offset": Range(0.0, 1.0, integer=False),
}
MAX_EOS_IDS = 1024
NULL_MEANS = {"final_logit_softcapping": "no cap", "max_position_embeddings": "not given",
              "query_pre_attn_scalar": "attention scale 1.0"}  # optional fields


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def __post_init__(self):
        choice("rope_type", self.rope_type, ROPE_TYPES)
        for name, v in (("rope_theta", self.theta), ("partial_rotary_factor", self.partial_rotary_factor),
                        ("factor", self.factor)):
            number(name, v)


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


def short(v) -> str:
    """A value as shown in an error: its repr, at most ~80 characters."""
    s = _BRIEF.repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def join(items, sep=", ", budget=150) -> str:
    """`items` joined while they fit in `budget` characters, then how many were left out."""
    out, used = [], 0
    for j, it in enumerate(items):
        if out and used + len(it) > budget:
            return sep.join(out) + f"{sep}... and {len(items) - j} more"
        out.append(it)
        used += len(it) + len(sep)
    return sep.join(out)


def number(path: str, v, key: str | None = None):
    """The one rule for a numeric config value: the type and range of FIELD_RANGES[key] (default: the
    path's last name). Returns it as int or float; ValueError naming path, value and range."""
    r = FIELD_RANGES[key or path.rsplit(".", 1)[-1]]
    if v is None:
        raise ValueError(f"config field {path!r} is missing: must be {r}")
    if v not in r:
        null = NULL_MEANS.get(path)
        raise ValueError(f"config field {path!r}={short(v)} must be {r}" + (f" (or null: {null})" if null else ""))
    return int(v) if r.integer else float(v)


def int_field(d, key, default):
    """`number` of d[key], or of `default` where the dict has no such key."""
    return number(key, d.get(key, default))


def choice(path: str, v, options: tuple[str, ...]) -> str:
    """A string field that must be one of `options` (NotImplementedError: the others are formats or
    features this implementation does not have)."""
    if not isinstance(v, str) or v not in options:
        raise NotImplementedError(f"config field {path!r}={short(v)} is not supported: expected one of {options}")
    return v


def flag(key, v) -> bool:
    """A JSON flag: true / false (null and 0 / 1 accepted); a string such as "false" is an error."""
    if v is None or isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise ValueError(f"config field {key!r}={short(v)} must be true or false")


def eos_ids(v, vocab_size: int) -> tuple[int, ...]:
    """config.json's eos_token_id: absent, a token id, or a list of at most MAX_EOS_IDS of them."""
    if v is None:
        return ()
    ids = v if isinstance(v, (list, tuple)) else [v]
    r = FIELD_RANGES["eos_token_id"]
    if len(ids) > MAX_EOS_IDS or not all(t in r and isinstance(t, int) and t < vocab_size for t in ids):
        raise ValueError(f"config field 'eos_token_id'={short(v)} must be a token id in [0, vocab_size="
                         f"{vocab_size}) or a list of at most {MAX_EOS_IDS} of them")
    return tuple(ids)
