"""A static-shape KV cache: one K and one V buffer per layer that owns K/V, plus per-row lengths.

Rows of a batch may hold different lengths. Rolling back is `cache.replace(lengths=new_lengths)`:
stale entries past a row's length are never visible (a query at position p only sees keys <= p,
and every key in [length, p] was written by the call that owns p) and are overwritten later.
Sliding layers keep the full capacity (no ring buffer): simpler, rollback needs no slack, and the
attention reduction length is the same for decode and verify (part of row invariance).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .config import TargetConfig


@struct.dataclass
class KVCache:
    """k[j], v[j]: `[B, capacity, num_kv_heads, head_dim]` of layer `config.cache_layers[j]` (RoPE'd,
    normed keys; normed values). lengths: int32 `[B]`, the number of valid positions per row."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def dtype(self):
        return self.k[0].dtype


def init_cache(config: TargetConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache (lengths 0) for `batch` rows of up to `capacity` positions each."""
    if batch < 1 or capacity < 1:
        raise ValueError(f"init_cache needs batch >= 1 and capacity >= 1, got batch={batch}, capacity={capacity}")
    if not config.cache_layers:
        raise ValueError("config has no layer that owns K/V (num_kv_shared_layers == num_hidden_layers): "
                         "that is an assistant config, not a target")
    shapes = [(batch, capacity, config.layer_kv_heads[i], config.layer_head_dims[i]) for i in config.cache_layers]
    return KVCache(k=tuple(jnp.zeros(s, dtype) for s in shapes),
                   v=tuple(jnp.zeros(s, dtype) for s in shapes),
                   lengths=jnp.zeros((batch,), jnp.int32))


def write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write `new [B, T, ...]` into `buf [B, C, ...]` at per-row offsets `start [B]`.

    Positions at or past C are dropped (a scatter, not dynamic_update_slice, which would clamp and
    so shift the whole write onto valid entries): the padding rows of a bucketed decode step may run
    past the end of a full cache, the real rows never do."""
    b, t = new.shape[:2]
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    cols = start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return buf.at[rows, cols].set(new.astype(buf.dtype), mode="drop")
