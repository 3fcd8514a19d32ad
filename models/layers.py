"""Building blocks shared by the target and the assistant: linear, RMSNorm, RoPE, MLP, attention.

Numerics follow HF Gemma 4 (the test reference): activations in the params dtype, RMSNorm, softmax
and RoPE angles in float32, attention scale 1.0. Every linear goes through `quantized_matmul`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import (ROW_TILE, DispatchConfig, Layer, attention_head_dim_ok, quantized_matmul,
                            quantized_matmul_many)
# the attention kernels and, beside each, its XLA counterpart (the reference, and the CPU path)
from jaxspec.kernels.decode_attention import decode_attention, dense_attention, visible  # noqa: F401
from jaxspec.kernels.flash_attention import blocked_attention, flash_attention

from .config import RopeConfig


def linear(x: jax.Array, w, matmul: DispatchConfig) -> jax.Array:
    """`x @ w.T` for a float `[N, K]` weight or a QuantizedWeight; output in x's dtype."""
    return quantized_matmul(x, w, config=matmul)


def linear_many(x: jax.Array, ws, matmul: DispatchConfig) -> tuple[jax.Array, ...]:
    """`linear(x, w)` for each w of the projections that read one x (q/k/v, gate/up), through
    `quantized_matmul_many` (one launch where the dispatch can)."""
    return quantized_matmul_many(x, ws, config=matmul)


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4 RMSNorm (plain `w`, not `1 + w`); float32 math, result in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if w is not None:
        y = y * w.astype(jnp.float32)
    return y.astype(x.dtype)


def activation(x: jax.Array, name: str) -> jax.Array:
    return jax.nn.gelu(x, approximate=name != "gelu")


def inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Float32 inverse frequencies `[head_dim // 2]`. "proportional" rotates only the first
    `partial_rotary_factor * head_dim / 2` pairs, with exponents over the full head_dim; the
    rest get frequency 0 (cos 1, sin 0), i.e. pass through. "linear" divides the default's
    frequencies by `factor` (HF's linear scaling)."""
    if rope.rope_type in ("default", "linear"):
        exps = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        out = (1.0 / (np.float32(rope.theta) ** exps)).astype(np.float32)
        return out if rope.rope_type == "default" else (out / np.float32(rope.factor)).astype(np.float32)
    n_rot = int(rope.partial_rotary_factor * head_dim // 2)
    exps = np.arange(0, 2 * n_rot, 2, dtype=np.float32) / np.float32(head_dim)
    rot = (1.0 / (np.float32(rope.theta) ** exps)).astype(np.float32)
    out = np.concatenate([rot, np.zeros(head_dim // 2 - n_rot, np.float32)])
    return (out / np.float32(rope.factor)).astype(np.float32)


def rope_tables(positions: jax.Array, rope: RopeConfig, head_dim: int, dtype):
    """cos, sin `[..., head_dim]` for integer positions `[...]`, cast to the activation dtype."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(rope, head_dim))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on `x [B, T, H, D]` with cos/sin `[B, T, D]`."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rot * sin[:, :, None, :]


def mlp(x: jax.Array, gate, up, down, act: str, matmul: DispatchConfig) -> jax.Array:
    g, u = linear_many(x, (gate, up), matmul)
    return linear(activation(g, act) * u, down, matmul)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              window: int | None = None, *, matmul: DispatchConfig | None = None, q_block: int = 256,
              k_block: int = 512, rows: int | None = None) -> jax.Array:
    """Scaled-by-1.0 GQA attention with the mask given by positions: the one attention entry point.

    q `[B, T, Hq, D]`, k/v `[B, C, Hkv, D]`, q_pos int32 `[B, T]` the queries' absolute positions,
    k_pos int32 `[B, C]` each key slot's absolute position (`cache.EMPTY` for a slot that must stay
    hidden). Key c is visible to query t iff `k_pos[c] <= q_pos[t]` and, with a window,
    `k_pos[c] > q_pos[t] - window`. Returns `[B, T, Hq * D]` in q's dtype.

    Chooses by the static T and `matmul.attention_kernels` (the model's DispatchConfig): T <= ROW_TILE
    (decode, verify) runs `decode_attention` (the Pallas flash-decoding kernel) or `dense_attention`
    (the einsum reference); both give a query the same bits whatever T, the property greedy parity
    rests on. Longer blocks (prefill) run `flash_attention` (Pallas) or, in XLA, on a CPU
    `dense_attention_blocks` (a query's decode bits at any prefill width: one request, one text) and
    elsewhere `blocked_attention` (online softmax); none builds the [T, C] score matrix. A head dim the kernels cannot tile (not
    a power of two >= 16) takes the XLA path.

    k and v may be `Layer`s of stacked caches (one index for both): the kernels read the layer in
    place, the XLA path takes the slice.

    `rows` (static): only the first `rows` queries are used by the caller (a decode step or verify
    padded to the row bucket); the others come back as zeros, not computed. Each query's result is
    independent of the others' (both paths), so the used rows are bitwise what the padded call
    gives, and a long cache is read for the real queries only (a [1, 8]-padded decode step read it
    for 8: 339 against ~140 us per global layer at 131K on the H200)."""
    b, t, _, d = q.shape
    if rows is not None and rows < t:
        out = attention(q[:, :rows], k, v, q_pos[:, :rows], k_pos, window, matmul=matmul, q_block=q_block,
                        k_block=k_block)
        return jnp.pad(out, ((0, 0), (0, t - rows), (0, 0)))
    layer = None
    if isinstance(k, Layer) or isinstance(v, Layer):
        if not (isinstance(k, Layer) and isinstance(v, Layer) and k.index is v.index):
            raise ValueError("attention: k and v must both be plain arrays or both Layers of one index")
        layer = k.index
    if matmul is not None and matmul.attention_kernels and attention_head_dim_ok(d):
        fn = decode_attention if t <= ROW_TILE else flash_attention
        if layer is not None:
            k, v = k.stack, v.stack
        return fn(q, k, v, q_pos, k_pos, window, layer=layer, interpret=matmul.interpret_mode).reshape(b, t, -1)
    if layer is not None:
        k, v = k.take(), v.take()
    if t <= ROW_TILE:
        return dense_attention(q, k, v, visible(q_pos, k_pos, window))
    if jax.default_backend() == "cpu":
        return dense_attention_blocks(q, k, v, q_pos, k_pos, window)
    return blocked_attention(q, k, v, q_pos, k_pos, window, q_block=q_block, k_block=k_block)


def dense_attention_blocks(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                           window: int | None = None) -> jax.Array:
    """`dense_attention` for any number of queries, ROW_TILE at a time (lax.map): the CPU's path for
    a prefill. A query then gets the bits a decode step gives it whatever the prefill's width
    (generate's prompt bucket, an engine's 128-token lanes) and the cache's size, which an online
    softmax over key blocks (`blocked_attention`, whose sums follow the block width and the
    causal skips) does not. It reads every key block for every query block, about twice the causal
    work of `blocked_attention` (the GPU's XLA fallback keeps that one)."""
    b, t, hq, d = q.shape
    n = -(-t // ROW_TILE)
    qp = jnp.pad(q, ((0, 0), (0, n * ROW_TILE - t), (0, 0), (0, 0)))
    pp = jnp.pad(q_pos, ((0, 0), (0, n * ROW_TILE - t)), mode="edge")
    qs = jnp.moveaxis(qp.reshape(b, n, ROW_TILE, hq, d), 1, 0)
    ps = jnp.moveaxis(pp.reshape(b, n, ROW_TILE), 1, 0)
    out = jax.lax.map(lambda a: dense_attention(a[0], k, v, visible(a[1], k_pos, window)), (qs, ps))
    return jnp.moveaxis(out, 0, 1).reshape(b, n * ROW_TILE, hq * d)[:, :t]


def scale_of(value: float, dtype) -> jax.Array:
    """A Python scale rounded to the activation dtype first (HF casts its embed scale that way)."""
    return jnp.asarray(value, dtype=jnp.float32).astype(dtype)


def embed_scale(hidden: int) -> float:
    return math.sqrt(hidden)
