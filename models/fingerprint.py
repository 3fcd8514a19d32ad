"""Which target an assistant was trained for: a fingerprint of the target, kept in the assistant's
config.json (`"target"`: its name, `"target_fingerprint"`: this dict) and checked when the
assistant is loaded against a target (`models.load_assistant(path, target=...)`).

The fingerprint is the target's architecture (a SHA-256 over the config fields that shape the
model) and a sample of its embedding table: the first `DIMS` values of `ROWS` rows spread over the
vocabulary, in float32. Two loads of the same weights agree whatever their dtype or storage
(float, the GGUF's 8-bit rows, a 4-bit requantization), while another model's table is unrelated
to it: the check accepts a relative L2 distance of the samples up to `TOLERANCE` (a 4-bit
requantization moves them by a few percent; an unrelated table by about sqrt(2)).
"""
from __future__ import annotations

import hashlib
import json

import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import take_rows

from .config import TargetConfig

ROWS, DIMS = 16, 32
TOLERANCE = 0.25
_ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "layer_types", "layer_head_dims", "layer_kv_heads", "sliding_window",
                "tie_word_embeddings", "model_type")


def _arch_sha256(cfg: TargetConfig) -> str:
    fields = {k: getattr(cfg, k) for k in _ARCH_FIELDS}
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _sample(target) -> tuple[list[int], np.ndarray]:
    v = target.config.vocab_size
    rows = [int(i) for i in np.linspace(0, v - 1, ROWS).round()]
    dims = min(DIMS, target.config.hidden_size)
    table = take_rows(target.params["embed_tokens"], jnp.asarray(rows, jnp.int32), jnp.float32)
    return rows, np.asarray(table[:, :dims], np.float64)


def target_fingerprint(target) -> dict:
    """The fingerprint dict of a models.Target (JSON-ready)."""
    rows, sample = _sample(target)
    return {"config_sha256": _arch_sha256(target.config), "embed_rows": rows,
            "embed_sample": [[float(f"{x:.6g}") for x in r] for r in sample]}


def mismatch(fingerprint: dict, target) -> str | None:
    """Why `target` is not the one `fingerprint` was taken of (one phrase), or None when it is."""
    try:
        want_arch, rows = fingerprint["config_sha256"], [int(i) for i in fingerprint["embed_rows"]]
        want = np.asarray(fingerprint["embed_sample"], np.float64)
    except (KeyError, TypeError, ValueError):
        return f"its target_fingerprint is malformed ({str(fingerprint)[:60]})"
    if want_arch != _arch_sha256(target.config):
        return "the target's architecture differs"
    got_rows, got = _sample(target)
    if got_rows != rows or got.shape != want.shape:
        return "the target's embedding sample has another shape"
    dist = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    if not dist <= TOLERANCE:
        return f"the target's embedding table differs (relative distance {dist:.2f} > {TOLERANCE})"
    return None
