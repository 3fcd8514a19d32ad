"""The Gemma 4 MTP assistant (drafter): Q-only layers over the target's cached K/V.

Params: the assistant's inner text model under its HF names without "model." ("embed_tokens",
"layers.0.self_attn.q_proj", "norm", ...) plus the top-level modules under their own names
("pre_projection", "post_projection", "lm_head" when untied, "masked_embedding.centroids",
"masked_embedding.token_ordering"; models.params.TOP_LEVEL, assistant_shapes).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from jaxspec.kernels import DispatchConfig, take_rows

from .cache import KVCache
from .config import SLIDING, AssistantConfig, check_fit
from .layers import apply_rope, attention, linear, mlp, rms_norm, rope_tables, visible
from .params import assistant_shapes, check_params
from . import shard as tp_shard
from .target import Target, embed, shared_kv


@struct.dataclass
class Assistant:
    """Static config and matmul as for Target (`matmul` defaults to `DispatchConfig()`)."""
    config: AssistantConfig = struct.field(pytree_node=False)
    params: dict
    matmul: DispatchConfig = struct.field(pytree_node=False, default_factory=DispatchConfig)
    tp: tp_shard.TensorParallel | None = struct.field(pytree_node=False, default=None)  # set by models.shard

    @property
    def dtype(self):
        return self.params["pre_projection"].dtype


def visible_keys(lengths: jax.Array, capacity: int, sliding_window: int | None,
                 key_pos: jax.Array | None = None) -> jax.Array:
    """`[B, C]` bool: the target-cache keys one draft step reads. Full layers: every committed key
    (k < lengths). Sliding layers: the last `sliding_window + 1` committed keys, i.e.
    lengths - W - 1 <= k < lengths. That is HF's bidirectional window |i - j| <= W laid over the
    flipped shared K/V (Gemma4AssistantForCausalLM.create_attention_masks). `key_pos [B, C]`: the
    absolute position each slot holds (a ring buffer, `shared_kv`); default slot c holds position c.
    It is `layers.visible` for a query at position lengths - 1 with window W + 1, the mask
    `assistant_stack` passes to attention."""
    b = lengths.shape[0]
    if key_pos is None:
        key_pos = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32)[None, :], (b, capacity))
    window = None if sliding_window is None else sliding_window + 1
    return visible(lengths.astype(jnp.int32)[:, None] - 1, key_pos.astype(jnp.int32), window)[:, 0]


def draft_step(assistant: Assistant, target: Target, cache: KVCache, token: jax.Array, h_prev: jax.Array,
               position: jax.Array):
    """One MTP draft step -> `(logits float32 [B, V], h_next [B, H_target])`.

    token `[B]` int32: the last token (embedded with the TARGET's table, times sqrt(H_target)).
    h_prev `[B, H_target]`: a target post-final-norm hidden state, or the previous step's h_next.
    position `[B]` int32: the query position for RoPE, HF's convention: `position = cache.lengths`,
    the position of the bonus token (the first token not yet in the cache), held constant over the
    draft steps of a round (mlx-vlm uses lengths - 1; we match HF, our test reference).

    Which values to pass:
      * after prefill of a prompt of length L (cache.lengths == L): token = the bonus (argmax of the
        last prompt position), h_prev = the prefill hidden at position L - 1, position = L.
      * after a verify of [bonus, d_0 .. d_{K-2}] with `a` drafts accepted and the cache rolled back to
        n = old_length + a + 1: token = the target's token at verify index a (the new bonus),
        h_prev = the verify hidden at index a, position = n.
      * later steps of the same round: token = the previous draft, h_prev = the previous h_next,
        position unchanged. The draft tokens are never written to any cache.
    Keys read: those of `visible_keys(cache.lengths, ...)` from the target's last non-shared full and
    sliding layers, so roll the cache back BEFORE drafting.
    """
    acfg, tcfg = assistant.config, target.config
    check_fit(acfg, tcfg)
    token = jnp.asarray(token)
    if token.ndim != 1:
        raise ValueError(f"token must be [B], got shape {tuple(token.shape)}")
    b = token.shape[0]
    if h_prev.shape != (b, tcfg.hidden_size):
        raise ValueError(f"h_prev has shape {tuple(h_prev.shape)}, expected {(b, tcfg.hidden_size)}")
    if cache.batch != b:
        raise ValueError(f"token has batch {b} but the cache has batch {cache.batch}")
    if assistant.tp != target.tp:
        raise ValueError("the assistant and the target must be sharded alike: models.shard both over one mesh "
                         f"(assistant: {assistant.tp}, target: {target.tp})")
    if assistant.tp is not None:
        if acfg.draft_vocab_size:
            raise ValueError("a trimmed draft vocabulary (draft_vocab_size) is not supported on a sharded assistant")
        return _draft_step_sharded(assistant, target, cache, token, h_prev, position)
    return _draft_step(assistant, target, cache, token, h_prev, position)


def _draft_step_sharded(assistant, target, cache, token, h_prev, position):
    """_draft_step per shard (models.shard): local query heads over the target cache's local KV
    heads; logits split by vocabulary (whole with ordered embeddings)."""
    tp, acfg = assistant.tp, assistant.config
    cspec = tp_shard.cache_specs(target, cache, tp.size, tp.axis)
    out = (PartitionSpec() if acfg.use_ordered_embeddings else
           tp_shard.logits_spec(assistant, _head(assistant), tp.axis, 2),
           PartitionSpec())
    rep = PartitionSpec()
    args = [(assistant, tp_shard.model_specs(assistant)), (target, tp_shard.model_specs(target)), (cache, cspec),
            (token, rep), (h_prev, rep), (jnp.asarray(position, jnp.int32), rep)]
    return tp_shard.run_sharded(_draft_step, assistant, args, out)


def _head(assistant: Assistant):
    p = assistant.params
    return p["embed_tokens"] if assistant.config.tie_word_embeddings else p["lm_head"]


def _draft_step(assistant, target, cache, token, h_prev, position):
    b = token.shape[0]
    lengths = cache.lengths.astype(jnp.int32)[:, None]
    pos = jnp.broadcast_to(jnp.asarray(position, jnp.int32).reshape(-1), (b,))[:, None]
    hn = assistant_stack(assistant, target, token[:, None], h_prev[:, None], shared_kv(target.config, cache), lengths,
                         pos)[:, 0]
    out, h_next = _finish(assistant, hn)
    return full_logits(assistant, out), h_next


def draft_logits(assistant: Assistant, target: Target, kv: dict, tokens: jax.Array, h_prev: jax.Array,
                 lengths: jax.Array, position: jax.Array):
    """The draft step for `Q` queries per row at once, over the HEAD's vocabulary -> (logits float32
    `[B, Q, N]`, h_next `[B, Q, H_target]`). N is the vocabulary, or `draft_vocab_size` with a
    trimmed head (`draft_ids` maps an index to its token). Arguments as `assistant_stack`'s. The
    loop's greedy drafting (`jaxspec.drafters.mtp.draft_chain`, Q = 1) and training (every position of
    a row at once) both run it, so what is trained is what drafts."""
    if assistant.tp is not None:
        raise ValueError("draft_logits runs an unsharded assistant (draft_step shards)")
    check_fit(assistant.config, target.config)
    hn = assistant_stack(assistant, target, tokens, h_prev, kv, lengths, position)
    return _finish(assistant, hn)


def _finish(assistant: Assistant, hn: jax.Array):
    """(head logits float32 [..., N], h_next [..., H_target]) from the final-normed hidden [..., Ha]."""
    acfg, p, mm = assistant.config, assistant.params, assistant.matmul
    h_next = linear(hn, p["post_projection"], mm)
    if acfg.draft_vocab_size:
        out = linear(hn, p["draft_head"], mm).astype(jnp.float32)
    elif acfg.use_ordered_embeddings:
        flat = hn.reshape(-1, hn.shape[-1])
        out = centroid_logits(assistant, flat, _head(assistant)).reshape(*hn.shape[:-1], acfg.vocab_size)
    else:
        out = linear(hn, _head(assistant), mm).astype(jnp.float32)
    return out, h_next


def draft_ids(assistant: Assistant, index: jax.Array) -> jax.Array:
    """Token ids of head indices (`draft_logits`' last axis): the trimmed vocabulary's, else the index."""
    index = index.astype(jnp.int32)
    if assistant.config.draft_vocab_size:
        return jnp.take(assistant.params["draft_vocab"].astype(jnp.int32), index)
    return index


def full_logits(assistant: Assistant, logits: jax.Array) -> jax.Array:
    """Head logits `[..., N]` over the whole vocabulary `[..., V]`: with a trimmed head every other
    token gets -inf, so no sampler ever drafts it (q = 0 there; the verify still scores every token,
    so the output is the target's whatever the head leaves out)."""
    acfg = assistant.config
    if not acfg.draft_vocab_size:
        return logits
    full = jnp.full(logits.shape[:-1] + (acfg.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., assistant.params["draft_vocab"].astype(jnp.int32)].set(logits)


def with_draft_vocab(assistant: Assistant, ids) -> Assistant:
    """`assistant` with a trimmed head over token ids `ids` (distinct, in range; their order is the
    head's): "draft_vocab" the ids, "draft_head" their rows of the head's table (the tied table:
    a shared one is the target's) in the assistant's dtype, gathered once here, not per step."""
    acfg = assistant.config
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"draft vocabulary must be a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.min() < 0 or ids.max() >= acfg.vocab_size or len(np.unique(ids)) != ids.size:
        raise ValueError(f"draft vocabulary ids must be distinct and in [0, {acfg.vocab_size})")
    if acfg.use_ordered_embeddings:
        raise ValueError("a trimmed draft vocabulary replaces the ordered-embeddings head: build the assistant "
                         "without use_ordered_embeddings")
    cfg = dataclasses.replace(acfg, draft_vocab_size=int(ids.size))
    ids = jnp.asarray(ids, jnp.int32)
    params = dict(assistant.params, draft_vocab=ids, draft_head=take_rows(_head(assistant), ids, assistant.dtype))
    return assistant.replace(config=cfg, params=params)


def assistant_stack(assistant: Assistant, target: Target, tokens: jax.Array, h_prev: jax.Array, kv: dict,
                    lengths: jax.Array, position: jax.Array) -> jax.Array:
    """The assistant's layers for `Q` queries per row at once -> the final-normed hidden `[B, Q, Ha]`.

    tokens `[B, Q]` (embedded with the target's table), h_prev `[B, Q, H_target]`, kv `{layer type:
    (k, v, pos)}` (`target.shared_kv`: k/v `[B, C, kv_heads, head_dim]`, pos `[B, C]` each slot's
    position), lengths `[B, Q]` the committed cache
    length each query sees (`visible_keys`), position `[B, Q]` the RoPE position. `draft_step` is
    this with Q = 1; training runs every position of a sequence at once through the same code."""
    a, p, mm = assistant.config.text, assistant.params, assistant.matmul
    dt = assistant.dtype
    b, q = tokens.shape
    e = embed(target, tokens, dt)
    h = linear(jnp.concatenate([e, h_prev.astype(dt)], axis=-1), p["pre_projection"], mm)
    eps = a.rms_norm_eps
    for i in range(a.num_hidden_layers):
        pre = f"layers.{i}."
        hd, nq = a.layer_head_dims[i], a.num_attention_heads
        k_src, v_src, k_pos = kv[a.layer_types[i]]
        # visible_keys as positions: k_pos <= lengths - 1 and (sliding) k_pos > lengths - 1 - (W + 1)
        window = a.sliding_window + 1 if a.layer_types[i] == SLIDING else None
        cos, sin = rope_tables(position, a.rope(i), hd, dt)
        xn = rms_norm(h, p[pre + "input_layernorm"], eps)
        qh = linear(xn, p[pre + "self_attn.q_proj"], mm).reshape(b, q, -1, hd)  # a shard's heads, if sharded
        qh = apply_rope(rms_norm(qh, p[pre + "self_attn.q_norm"], eps), cos, sin)
        o = attention(qh, k_src, v_src, lengths.astype(jnp.int32) - 1, k_pos, window, matmul=mm)
        o_proj, down = p[pre + "self_attn.o_proj"], p[pre + "mlp.down_proj"]
        o = tp_shard.reduce_rows(assistant, linear(o, o_proj, mm), o_proj, nq * hd)
        h = h + rms_norm(o, p[pre + "post_attention_layernorm"], eps)
        xn = rms_norm(h, p[pre + "pre_feedforward_layernorm"], eps)
        xn = mlp(xn, p[pre + "mlp.gate_proj"], p[pre + "mlp.up_proj"], down, a.hidden_activation, mm)
        xn = tp_shard.reduce_rows(assistant, xn, down, a.mlp_width(i))
        h = h + rms_norm(xn, p[pre + "post_feedforward_layernorm"], eps)
        h = h * p[pre + "layer_scalar"].astype(dt)
    return rms_norm(h, p["norm"], eps)


def centroid_logits(assistant: Assistant, hn: jax.Array, head) -> jax.Array:
    """Ordered-embeddings head: score the centroids, keep the top k clusters, compute exact logits for
    their k * V / num_centroids tokens and fill every other token with min(selected) - 1 (per row;
    HF takes the min over the whole batch, which only differs for B > 1 in the filler value)."""
    acfg, p, mm = assistant.config, assistant.params, assistant.matmul
    b = hn.shape[0]
    per = acfg.vocab_size // acfg.num_centroids
    scores = linear(hn, p["masked_embedding.centroids"], mm).astype(jnp.float32)
    _, top = jax.lax.top_k(scores, acfg.centroid_intermediate_top_k)  # [B, k]
    ordering = p["masked_embedding.token_ordering"].astype(jnp.int32).reshape(acfg.num_centroids, per)
    sel = ordering[top].reshape(b, -1)  # [B, k * per] token ids
    rows = tp_shard.embed_rows(assistant, head, sel, hn.dtype, acfg.vocab_size)  # [B, S, H]
    sl = jnp.einsum("bh,bsh->bs", hn, rows, preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST).astype(hn.dtype).astype(jnp.float32)
    fill = jnp.min(sl, axis=-1, keepdims=True) - 1.0
    out = jnp.broadcast_to(fill, (b, acfg.vocab_size))
    return out.at[jnp.arange(b)[:, None], sel].set(sl)


def make_assistant(config: AssistantConfig, params: dict, matmul: DispatchConfig | None = None) -> Assistant:
    """Build an Assistant after checking its params against the config (`matmul=None`: DispatchConfig())."""
    check_params(params, assistant_shapes(config), "assistant")
    return Assistant(config=config, params=params, matmul=DispatchConfig() if matmul is None else matmul)
