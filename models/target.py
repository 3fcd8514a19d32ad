"""The target model (Gemma 4, Gemma 3: models/families.py) as pure functions over a params pytree.

Params: a flat dict keyed by the HF module path without the checkpoint prefix ("embed_tokens",
"layers.3.self_attn.q_proj", "layers.3.input_layernorm", "layers.3.layer_scalar", "norm", ...).
Linear/embedding values are float `[N, K]` arrays or `QuantizedWeight`s; norms and scalars are float.
"""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from jaxspec.kernels import (DispatchConfig, Layer, QuantizedWeight, attention_head_dim_ok, quantized_matmul_parts,
                            take_rows)
from jaxspec.kernels.attention_inputs import attention_inputs
from jaxspec.kernels.paged_attention import paged_attention
from jaxspec.kernels.config import ROW_TILE
from jaxspec.kernels.xla import dense_rows
from jaxspec.kernels.stack import take

from .cache import EMPTY, KVCache, init_cache, paged_view, paged_write, ring_cols, write_cols, write_rows
from .config import TargetConfig
from .layer_scan import PREFIX, cache_entry, cache_entries, is_stacked, scan_plan, stack_params
from .layers import (activation, apply_rope, attention, linear, linear_many, mlp, rms_norm,
                     rope_tables, scale_of)
from .params import check_params, target_shapes
from . import shard as tp_shard


@struct.dataclass
class Target:
    """config and matmul are static (hashable) fields: a jitted function compiles once per pair.
    `matmul` is the dispatch every linear of the model uses; `DispatchConfig()` by default (it reads
    no environment; `load_target` and `presets.random_model` resolve `DispatchConfig.from_env(backend="auto")`)."""
    config: TargetConfig = struct.field(pytree_node=False)
    params: dict
    matmul: DispatchConfig = struct.field(pytree_node=False, default_factory=DispatchConfig)
    tp: tp_shard.TensorParallel | None = struct.field(pytree_node=False, default=None)  # set by models.shard

    @property
    def dtype(self):
        """The activation dtype: the final norm's, a float vector always held in the load dtype (not
        the embedding's: a QuantizedWeight's dtype is its scales', float32 in an exact GGUF load)."""
        return self.params["norm"].dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        return logits(self, ids)


def head_weight(target: Target):
    p = target.params
    return p["embed_tokens"] if target.config.tie_word_embeddings else p["lm_head"]


def embed(target: Target, tokens: jax.Array, dtype) -> jax.Array:
    """`E[ids] * sqrt(hidden)`, the scale rounded to the activation dtype first (as HF)."""
    e = tp_shard.embed_rows(target, target.params["embed_tokens"], tokens, dtype, target.config.vocab_size)
    return e * scale_of(target.config.embed_scale, dtype)


def _per_layer_inputs(target: Target, tokens, h0):
    """`[B, T, L, P]`: (RMSNorm(proj(h0) / sqrt(H)) + E_pl[ids] * sqrt(P)) / sqrt(2)."""
    cfg, p, mm = target.config, target.params, target.matmul
    n, pdim = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
    dt = h0.dtype
    tok = take_rows(p["embed_tokens_per_layer"], tokens, dt) * scale_of(pdim ** 0.5, dt)
    tok = tok.reshape(*tokens.shape, n, pdim)
    ctx = linear(h0, p["per_layer_model_projection"], mm) * (cfg.hidden_size ** -0.5)
    ctx = rms_norm(ctx.reshape(*tokens.shape, n, pdim), p["per_layer_projection_norm"], cfg.rms_norm_eps)
    return (ctx + tok) * (2.0 ** -0.5)


# The widest short forward (decode or verify) a row is computed at: K up to 8 fits it at B = 1-2, and
# more rows would make every B = 1 decode step run twice the rows through the non-matmul ops
# (measured: a 16-token bucket cost 1.5% of classic decode on the 12B, H200).
MAX_BUCKET = 8
CPU_BUCKET = 4  # row_bucket at batch 1 with the xla backend on a CPU


def row_bucket(target: Target, batch: int) -> int:
    """Token count every short forward (decode, verify) is computed at, for this batch size.

    A row's result may depend on how many rows an op sees (XLA picks kernels and fusions by shape:
    on the H200 a [1, 4] verify differed from four [1, 1] steps by up to 0.9 in the logits, on CPU
    by 1e-6 at B = 1). Computing every forward of T <= bucket tokens at exactly `bucket` tokens
    makes decode and verify one computation, so greedy speculative decoding is bit-exact by
    construction. The bucket keeps batch * bucket within the model's multirow matmul window
    (`target.matmul.multirow_max_rows`, at most ROW_TILE), where extra rows cost no weight traffic
    (the kernel reads each weight tile once for all of them), and at most MAX_BUCKET; without
    multirow it is 1. The xla backend on a CPU at batch 1 takes CPU_BUCKET rows (the loop's default
    K). A lone row was faster (~10% of a classic step on Gemma 3 270M), but XLA's CPU code gives a
    row other bits at 1 row than at 4 (op by op: the norms' reduce and their division), and the real
    Gemma 3 270M's greedy text then differed from classic decoding's (the bfloat16 exactness probe
    did not see it; tests/models/test_gemma3.py checks the verify against the steps). At batch 2 and more
    the same happens (a [B, 4] verify off by up to 0.12 from four [B, 1] steps on the default pair),
    so those keep the multirow bucket."""
    mm = target.matmul
    if mm.backend == "xla" and dense_rows() < ROW_TILE and batch == 1:
        return CPU_BUCKET
    window = mm.multirow_max_rows if mm.multirow else 1
    return max(1, min(window // batch, MAX_BUCKET))


def forward(target: Target, tokens: jax.Array, cache: KVCache, *, valid: jax.Array | None = None,
            logits_at: jax.Array | None = None):
    """Run `tokens [B, T]` int32 at positions `cache.lengths[:, None] + arange(T)`.

    Short blocks (T < row_bucket(target, B)) are padded with token 0 to the bucket and their pad
    keys hidden; outputs are sliced back to T (see row_bucket for why).
    `logits_at [B]` int32 (optional): compute logits only at that index of each row and return them
    as `[B, 1, V]` (a prefill needs one position; the full `[B, T, V]` float32 logits of a long
    prompt over a 262k vocabulary are gigabytes).

    Writes their K/V into the cache at those positions (per row) and returns
    `(logits float32 [B, T, V], hidden [B, T, H] post-final-norm, new_cache)` with
    `new_cache.lengths = cache.lengths + T` (lower it to roll back, or to the true prompt lengths after
    a right-padded ragged prefill). A query at position p sees keys k <= p (and k > p - window on
    sliding layers). `valid [B, T]` bool: keys of the new positions where it is False are hidden from
    every query (padding); their queries still produce (meaningless) outputs.
    Needs `cache.lengths + T <= cache.capacity` for every row (not checked under jit; positions past
    the capacity are dropped, never shifted onto valid entries).
    """
    check_tokens(tokens, target.config.vocab_size)
    b, t = tokens.shape
    bucket = row_bucket(target, b)
    if t < bucket:
        pad = bucket - t
        real = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)
        if valid is not None and valid.shape != (b, t):
            raise ValueError(f"valid has shape {valid.shape}, expected {(b, t)}")
        out, hidden, new = _run(target, jnp.pad(tokens, ((0, 0), (0, pad))), cache,
                                valid=jnp.concatenate([real, jnp.zeros((b, pad), bool)], axis=1),
                                capacity_tokens=t, logits_at=logits_at)
        return (out if logits_at is not None else out[:, :t]), hidden[:, :t], new.replace(lengths=cache.lengths + t)
    return _run(target, tokens, cache, valid=valid, capacity_tokens=t, logits_at=logits_at)


def _run(target: Target, tokens, cache: KVCache, *, valid, capacity_tokens: int, logits_at):
    """_forward, on a sharded target (models.shard) per shard under shard_map: local heads, FFN
    columns and vocabulary, the cache split by KV heads, logits out split by vocabulary."""
    if target.tp is None:
        return _forward(target, tokens, cache, valid=valid, capacity_tokens=capacity_tokens, logits_at=logits_at)
    tp = target.tp
    cspec = tp_shard.cache_specs(target, cache, tp.size, tp.axis)
    extra = {k: v for k, v in (("valid", valid), ("logits_at", logits_at)) if v is not None}

    def local(t_, tokens_, cache_, extra_):
        return _forward(t_, tokens_, cache_, valid=extra_.get("valid"), capacity_tokens=capacity_tokens,
                        logits_at=extra_.get("logits_at"))

    out = (tp_shard.logits_spec(target, head_weight(target), tp.axis), PartitionSpec(), cspec)
    args = [(target, tp_shard.model_specs(target)), (tokens, PartitionSpec()), (cache, cspec),
            (extra, {k: PartitionSpec() for k in extra})]
    return tp_shard.run_sharded(local, target, args, out)


def _forward(target: Target, tokens: jax.Array, cache: KVCache, *, valid, capacity_tokens: int, logits_at=None):
    cfg, p, mm = target.config, target.params, target.matmul
    t_real = capacity_tokens
    b, t = tokens.shape
    if cache.batch != b:
        raise ValueError(f"tokens have batch {b} but the cache has batch {cache.batch}")
    if t_real > cache.capacity:
        raise ValueError(f"{t_real} tokens do not fit a cache of capacity {cache.capacity}")
    if len(cache.k) != len(cache_entries(cfg)):
        raise ValueError(f"cache has {len(cache.k)} K/V buffers, the config needs {len(cache_entries(cfg))}")
    dt = target.dtype
    start = cache.lengths.astype(jnp.int32)
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    cap = cache.capacity
    real = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)
    if valid is not None and valid.shape != (b, t):
        raise ValueError(f"valid has shape {valid.shape}, expected {(b, t)}")
    new_pos = jnp.where(real, pos, EMPTY)  # the new keys' positions; hidden where not valid

    # Full-capacity buffers: slot = position; the new block's invalid slots hidden. A paged cache's
    # rows are read through views as wide as its table (`cache.narrow` may have cut it).
    view = cache.view_positions
    slot_pos = jnp.broadcast_to(jnp.arange(view, dtype=jnp.int32)[None, :], (b, view))
    if valid is not None:
        rel = slot_pos - start[:, None]
        inside = (rel >= 0) & (rel < t)
        hidden_new = inside & ~jnp.take_along_axis(real, jnp.clip(rel, 0, t - 1), axis=1)
        slot_pos = jnp.where(hidden_new, EMPTY, slot_pos)
    # Ring buffers (sliding layers of a long cache, models/cache.py): slot = position mod S.
    ring_pos = None
    if cache.pos is not None:
        s_ring = cache.pos.shape[1]
        cols = ring_cols(start, t, s_ring, cap, valid)
        ring_pos = write_cols(cache.pos, pos, cols)
        # Short blocks write first and read the ring (slots fixed per position: row invariance);
        # longer ones read the old contents below the start plus their own keys, then write.
        ring_short = t <= s_ring - (cfg.sliding_window or 0) - 1
        old_pos = jnp.where(cache.pos < start[:, None], cache.pos, EMPTY)
        # the long path's keys: old ring ++ new block; on the XLA path (a CPU) new ++ old, so a prefill from
        # an empty ring has its keys at slot = position, as a cache without a ring (dense_attention's
        # key blocks then see one layout whatever the ring's size: one request, one text)
        new_first = not mm.attention_kernels
        ring_keys_pos = ring_pos if ring_short else jnp.concatenate(
            [new_pos, old_pos] if new_first else [old_pos, new_pos], axis=1)

    h = embed(target, tokens, dt)
    pli = _per_layer_inputs(target, tokens, h) if cfg.has_per_layer_inputs else None
    tables = {}
    for i in range(cfg.num_hidden_layers):
        key = (cfg.is_sliding(i), cfg.layer_head_dims[i])
        if key not in tables:
            tables[key] = rope_tables(pos, cfg.rope(i), key[1], dt)
    # what every layer of this forward shares: shapes, positions, RoPE tables, the ring's plan
    step = SimpleNamespace(b=b, t=t, t_real=t_real, start=start, pos=pos, slot_pos=slot_pos, tables=tables,
                           cache=cache, hides=valid is not None)
    if cache.pos is not None:
        step.cols, step.ring_short, step.ring_keys_pos, step.new_first = cols, ring_short, ring_keys_pos, new_first
    ks, vs = list(cache.k), list(cache.v)
    plan = scan_plan(cfg)
    period, groups = plan.period, plan.groups
    if groups and is_stacked(p):
        packed, unpack = _pack_vectors(p, groups)

        def group(carry, xs):  # one repeat of the layer pattern: the scan's body, traced once
            h, kst, vst = carry
            g, pli_g, packed_g = xs
            kst, vst = list(kst), list(vst)
            vectors = unpack(packed_g)
            for j in range(period):
                h = _layer(target, j, h, kst, vst, _Weights(p, f"{PREFIX}{j}.", g, vectors), (j, g),
                           None if pli_g is None else pli_g[:, :, j], step, {})
            return (h, tuple(kst), tuple(vst)), None

        pli_s = None if pli is None else jnp.moveaxis(
            pli[:, :, :plan.scanned].reshape(b, t, groups, period, -1), 2, 0)
        (h, kst, vst), _ = jax.lax.scan(group, (h, tuple(ks[:period]), tuple(vs[:period])),
                                        (jnp.arange(groups, dtype=jnp.int32), pli_s, packed))
        ks[:period], vs[:period] = kst, vst
        first = plan.scanned
    else:  # per-layer params (a Target built by hand): the same layers, traced one by one
        first = 0
    new_kv = {}  # ring buffer -> (old ring ++ new block) K/V, for the long path's KV-shared layers
    for i in range(first, cfg.num_hidden_layers):
        h = _layer(target, i, h, ks, vs, _Weights(p, f"layers.{i}."), cache_entry(cfg, i),
                   None if pli is None else pli[:, :, i], step, new_kv)

    eps = cfg.rms_norm_eps
    hidden = rms_norm(h, norm_scale(cfg, p["norm"]), eps)
    at = hidden if logits_at is None else hidden[jnp.arange(b), logits_at.astype(jnp.int32)][:, None]
    return head_logits(target, at), hidden, cache.replace(k=tuple(ks), v=tuple(vs), lengths=start + t, pos=ring_pos)


def head_logits(target: Target, hidden: jax.Array) -> jax.Array:
    """float32 logits `[..., V]` of post-final-norm hidden states `[..., H]` (`forward`'s second
    output): the head and softcap `forward` applies. Scoring only some positions of a long row
    (the data stage scores continuations, not prompts) computes the head on those alone."""
    cfg = target.config
    out = linear(hidden, head_weight(target), target.matmul).astype(jnp.float32)
    if cfg.final_logit_softcapping is not None:
        c = cfg.final_logit_softcapping
        out = jnp.tanh(out / c) * c
    return out


class _Weights:
    """A layer's params: plain per-layer ones (`index` None) or layer `index` of the scan's stacks
    (linears as `Layer`s, read in place by the kernels; norms and scalars from `vectors`, this
    group's slice of them, see `_pack_vectors`)."""

    def __init__(self, params: dict, prefix: str, index=None, vectors: dict | None = None):
        self.params, self.prefix, self.index, self.vectors = params, prefix, index, vectors

    def linear(self, name: str):
        return _at(self.params[self.prefix + name], self.index)

    def vector(self, name: str):
        if self.vectors is not None:
            return self.vectors[self.prefix + name]
        return self.params[self.prefix + name]


def _pack_vectors(params: dict, groups: int):
    """The scan's norms and scalars (stacks of ndim <= 2) as one [groups, n] array per dtype, and
    `unpack(one group's rows) -> {name: vector}`. Sliced one by one, the ~40 vectors of a group
    each cost a small kernel per iteration (0.43 ms per 12B forward on the H200); packed, the scan
    slices one row per dtype and the vectors are static slices of it."""
    names = sorted(n for n, v in params.items()
                   if n.startswith(PREFIX) and not isinstance(v, QuantizedWeight) and jnp.ndim(v) <= 2)
    by_dtype: dict = {}
    for n in names:
        by_dtype.setdefault(jnp.dtype(params[n].dtype).name, []).append(n)
    packed = tuple(jnp.concatenate([jnp.reshape(params[n], (groups, -1)) for n in ns], axis=1)
                   for ns in by_dtype.values())

    def unpack(rows) -> dict:
        out = {}
        for ns, row in zip(by_dtype.values(), rows):
            at = 0
            for n in ns:
                shape = params[n].shape[1:]
                size = int(np.prod(shape, dtype=np.int64))
                out[n] = row[at:at + size].reshape(shape)
                at += size
        return out
    return packed, unpack


def _at(buf, index):
    return buf if index is None else Layer(buf, index)


def norm_scale(cfg: TargetConfig, w, factor: float = 1.0):
    """What an RMSNorm weight `w` multiplies by: `norm_offset + w` (Gemma 4: w itself; Gemma 3:
    1 + w, in float32 as HF), times `factor`: the attention scale, folded into q_norm (RoPE is
    linear, so scaling q before it is scaling the scores; exact when the scale is a power of two,
    as Gemma 3's 256 ** -0.5, else within a float32 rounding)."""
    if cfg.norm_offset == 0.0 and factor == 1.0:
        return w
    return (cfg.norm_offset + w.astype(jnp.float32)) * factor


def _layer(target: Target, i: int, h, ks: list, vs: list, w: _Weights, entry, pli_i, step: SimpleNamespace,
           new_kv: dict):
    """Decoder layer i (for a scanned layer: its position in the pattern) on h `[B, T, H]`: writes
    its K/V into `ks[slot], vs[slot]` (`entry` = (slot, index in the stack or None)) and returns h."""
    cfg, mm = target.config, target.matmul
    b, t, pos, cache = step.b, step.t, step.pos, step.cache
    slot, index = entry
    eps = cfg.rms_norm_eps
    hd, nq = cfg.layer_head_dims[i], cfg.num_attention_heads
    # A block pool: a decode or verify on the attention kernels writes its new K/V into the pool and
    # reads each row's blocks through the table (paged_attention); otherwise (the XLA path, a
    # prefill chunk) the layer reads and writes its rows' view, bitwise a contiguous buffer, and
    # scatters the new positions back.
    direct = slot in cache.paged and reads_pool(mm, hd, t)
    pool = None
    if slot in cache.paged and not direct:
        pool = (ks[slot], vs[slot], index)
        ks[slot], vs[slot], index = (paged_view(ks[slot], cache.table, index),
                                     paged_view(vs[slot], cache.table, index), None)
    cos, sin = step.tables[(cfg.is_sliding(i), hd)]

    x = rms_norm(h, norm_scale(cfg, w.vector("input_layernorm")), eps)
    q_scale = norm_scale(cfg, w.vector("self_attn.q_norm"), cfg.attention_scale)
    k_scale = None if cfg.kv_shared(i) else norm_scale(cfg, w.vector("self_attn.k_norm"))
    names = ["q_proj"] + ([] if cfg.kv_shared(i) else ["k_proj"] if cfg.k_eq_v(i) else ["k_proj", "v_proj"])
    projections = [w.linear("self_attn." + name) for name in names]
    ring = cache.is_ring(slot)
    if mm.attention_kernels and attention_head_dim_ok(hd) and not (ring and not step.ring_short):
        # one kernel from the projection's split-K partials to q and the cache's new K/V
        q, *kv = quantized_matmul_parts(x, projections, config=mm)
        k_parts, v_parts = (kv + [None, None])[:2]
        cols = step.cols if ring else step.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if kv and direct:  # the new K/V into [B, T] buffers of their own, then into the pool
            bufs = [jnp.zeros((b, t) + ks[slot].shape[-2:], ks[slot].dtype) for _ in range(2)]
            q, k_new, v_new = attention_inputs(
                q, k_parts, v_parts, q_scale, k_scale, cos, sin, *bufs,
                jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t)), eps=eps,
                interpret=mm.interpret_mode, norm_v=cfg.value_norm)
            ks[slot] = paged_write(ks[slot], cache.table, k_new, step.start, index)
            vs[slot] = paged_write(vs[slot], cache.table, v_new, step.start, index)
        else:
            q, k_new, v_new = attention_inputs(
                q, k_parts, v_parts, q_scale, k_scale if kv else None, cos, sin,
                *((ks[slot], vs[slot], cols) if kv else (None, None, None)), eps=eps, layer=index,
                interpret=mm.interpret_mode, norm_v=cfg.value_norm)
            if kv:
                ks[slot], vs[slot] = k_new, v_new
        kv = []
    else:
        q, *kv = linear_many(x, projections, mm)
        # heads from the shapes: a sharded model's projections hold a shard's heads
        q = apply_rope(rms_norm(q.reshape(b, t, -1, hd), q_scale, eps), cos, sin)
    if kv:
        kr = kv[0].reshape(b, t, -1, hd)
        vr = kr if cfg.k_eq_v(i) else kv[1].reshape(b, t, -1, hd)
        k = apply_rope(rms_norm(kr, k_scale, eps), cos, sin)
        v = rms_norm(vr, None, eps) if cfg.value_norm else vr
        if ring:
            old_k, old_v = ks[slot], vs[slot]
            ks[slot], vs[slot] = write_cols(old_k, k, step.cols, index), write_cols(old_v, v, step.cols, index)
            if not step.ring_short:
                old_k, old_v = take(_at(old_k, index)), take(_at(old_v, index))
                pair = lambda old, new: [new, old] if step.new_first else [old, new]  # noqa: E731
                new_kv[slot] = (jnp.concatenate(pair(old_k, k.astype(old_k.dtype)), axis=1),
                                jnp.concatenate(pair(old_v, v.astype(old_v.dtype)), axis=1))
        elif direct:
            ks[slot] = paged_write(ks[slot], cache.table, k, step.start, index)
            vs[slot] = paged_write(vs[slot], cache.table, v, step.start, index)
        else:
            ks[slot] = write_rows(ks[slot], k, step.start, index)
            vs[slot] = write_rows(vs[slot], v, step.start, index)
    window = cfg.sliding_window if cfg.is_sliding(i) else None
    if direct:
        a = _pool_attention(q, ks[slot], vs[slot], index, window, step, mm)
    elif ring and not step.ring_short:
        a = attention(q, *new_kv[slot], pos, step.ring_keys_pos, window, matmul=mm, rows=step.t_real)
    else:
        a = attention(q, _at(ks[slot], index), _at(vs[slot], index), pos,
                      step.ring_keys_pos if ring else step.slot_pos, window, matmul=mm, rows=step.t_real)
    if pool is not None:  # the new positions back into the pool; the view is dropped
        pk, pv, at = pool
        if not cfg.kv_shared(i):
            cols = jnp.clip(step.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :], 0,
                            cache.view_positions - 1)
            pk, pv = (paged_write(p_, cache.table, jnp.take_along_axis(x, cols[:, :, None, None], axis=1), step.start,
                                  at) for p_, x in ((pk, ks[slot]), (pv, vs[slot])))
        ks[slot], vs[slot] = pk, pv
    o_proj, down = w.linear("self_attn.o_proj"), w.linear("mlp.down_proj")
    a = tp_shard.reduce_rows(target, linear(a, o_proj, mm), o_proj, nq * hd)
    h = h + rms_norm(a, norm_scale(cfg, w.vector("post_attention_layernorm")), eps)

    x = rms_norm(h, norm_scale(cfg, w.vector("pre_feedforward_layernorm")), eps)
    x = mlp(x, w.linear("mlp.gate_proj"), w.linear("mlp.up_proj"), down, cfg.hidden_activation, mm)
    x = tp_shard.reduce_rows(target, x, down, cfg.mlp_width(i))
    h = h + rms_norm(x, norm_scale(cfg, w.vector("post_feedforward_layernorm")), eps)

    if pli_i is not None:
        g = activation(linear(h, w.linear("per_layer_input_gate"), mm), cfg.hidden_activation) * pli_i
        g = linear(g, w.linear("per_layer_projection"), mm)
        h = h + rms_norm(g, w.vector("post_per_layer_input_norm"), eps)
    return h * w.vector("layer_scalar").astype(h.dtype) if cfg.layer_scalar else h


def reads_pool(mm: DispatchConfig, head_dim: int, t: int) -> bool:
    """Whether a forward of `t` tokens reads a block pool in place (`paged_attention`, through the
    table) rather than through a gathered view: a decode or verify (t <= ROW_TILE) on the attention
    kernels, when `mm.paged_attention` asks for it. The XLA path keeps the view: its attention over
    the view is the contiguous cache's computation, which the paged cache promises bitwise on a CPU."""
    return mm.paged_attention and mm.attention_kernels and attention_head_dim_ok(head_dim) and t <= ROW_TILE


def _pool_attention(q, k_pool, v_pool, index, window, step: SimpleNamespace, mm: DispatchConfig):
    """`models.attention` of a short block over a block pool (`reads_pool`): the real rows' queries
    over each row's keys below its start + real tokens; `[B, T, Hq * D]`, the pad rows zeros."""
    b, t, r = step.b, step.t, step.t_real
    k_pos = step.slot_pos if step.hides else None  # a valid mask hides some new slots; else slot = position
    out = paged_attention(q[:, :r], k_pool, v_pool, step.cache.table, step.start + r, step.pos[:, :r], window,
                          k_pos=k_pos, layer=index, interpret=mm.interpret_mode).reshape(b, r, -1)
    return jnp.pad(out, ((0, 0), (0, t - r), (0, 0)))


def shared_kv(config: TargetConfig, cache: KVCache) -> dict[str, tuple[jax.Array, jax.Array, jax.Array]]:
    """The K/V the assistant reads: {"sliding_attention": (k, v, pos), "full_attention": (k, v, pos)}
    from the last non-shared layer of each type: k, v `[B, L, kv_heads, head_dim]` (`Layer`s of the
    cache's stacks for a scanned layer: `pallas_kernels.stack.take` gives the array) and pos int32
    `[B, L]` the absolute position each slot holds (`arange(L)` for a full-capacity buffer, the
    cache's ring positions for a ring; only slots below cache.lengths are committed)."""
    out = {}
    for t in sorted(set(config.layer_types)):
        i = config.store_layer(t)
        if i is not None:
            j, index = cache_entry(config, i)
            if j in cache.paged:  # a block pool: the rows' views, slot = position
                n = cache.view_positions
                pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (cache.batch, n))
                out[t] = (paged_view(cache.k[j], cache.table, index), paged_view(cache.v[j], cache.table, index), pos)
                continue
            if cache.is_ring(j):
                pos = cache.pos
            else:
                n = cache.k[j].shape[-3]
                pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (cache.batch, n))
            out[t] = (_at(cache.k[j], index), _at(cache.v[j], index), pos)
    return out


def logits(target: Target, ids: jax.Array) -> jax.Array:
    """Cache-free full-sequence scoring: `ids [B, T]` int32 -> logits float32 `[B, T, V]`."""
    ids = jnp.asarray(ids)
    check_tokens(ids, target.config.vocab_size)
    cache = init_cache(target.config, ids.shape[0], ids.shape[1], target.dtype)
    return forward(target, ids, cache)[0]


def check_tokens(tokens, vocab: int) -> None:
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got {tokens.dtype}")
    if 0 in tokens.shape:
        raise ValueError(f"tokens must be non-empty, got shape {tuple(tokens.shape)}")


def make_target(config: TargetConfig, params: dict, matmul: DispatchConfig | None = None) -> Target:
    """Build a Target after checking every expected param is present with the right shape; the
    scanned layers' params are stacked (`layer_scan.stack_params`). `matmul=None` gives
    `DispatchConfig()` (no environment read)."""
    if not config.cache_layers:
        raise ValueError("every layer of this config is KV-shared: that is an assistant stack, not a target")
    check_params(params, target_shapes(config), "target")
    return Target(config=config, params=stack_params(config, params),
                  matmul=DispatchConfig() if matmul is None else matmul)

