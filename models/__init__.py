"""Gemma 4 target and MTP assistant in JAX, on the 4-bit quantized-matmul kernels.

    target = models.load_target(path, dtype=jnp.bfloat16)           # or presets.random_model(cfg, key)
    cache = models.init_cache(target.config, batch, capacity, target.dtype)
    logits, hidden, cache = models.forward(target, tokens, cache)   # prefill [B,T] / decode [B,1] / verify [B,K]
    cache = cache.replace(lengths=new_lengths)                      # rollback
    d_logits, h_next = models.draft_step(assistant, target, cache, token, h_prev, position)

Loaders and random_model resolve the matmul dispatch once (`DispatchConfig.from_env(backend="auto")`:
XLA on a CPU, the Pallas kernels on a GPU, unless given `matmul=`); a Target/Assistant built directly
holds `DispatchConfig()`. Imports run one way (tests/test_import_graph.py):
checkpoint, presets -> assistant -> target -> layers, cache, params -> config -> families -> the
family modules (gemma4, gemma3) -> family_spec, config_fields; and everything -> pallas_kernels.
See docs/models.md for the design and the draft position convention.
"""
from . import presets
from .assistant import (Assistant, assistant_stack, centroid_logits, draft_ids, draft_logits, draft_step, full_logits,
                        make_assistant, visible_keys, with_draft_vocab)
from jaxspec.kernels import ROW_TILE

from .cache import (EMPTY, KVCache, cache_bytes, cuts_rings, init_cache, init_paged_cache, narrow, paged_block_bytes,
                    paged_cache_bytes, ring_size, widen)
from .checkpoint import load_assistant, load_target, quantize_model, save
from .config import AssistantConfig, RopeConfig, TargetConfig, check_fit
from .dense import prepare_dense, weight_bytes
from .params import assistant_shapes, target_shapes
from .shard import shard
from .target import Target, embed, forward, head_logits, logits, make_target, row_bucket, shared_kv

__all__ = [
    "EMPTY", "ROW_TILE", "cache_bytes", "cuts_rings", "init_paged_cache", "narrow", "paged_block_bytes",
    "paged_cache_bytes", "ring_size",
    "Assistant", "AssistantConfig", "assistant_stack", "KVCache", "RopeConfig", "Target", "TargetConfig", "assistant_shapes",
    "centroid_logits", "check_fit", "draft_ids", "draft_logits", "draft_step", "full_logits", "embed", "forward", "head_logits", "init_cache", "load_assistant",
    "load_target", "logits", "make_assistant", "make_target", "prepare_dense", "presets", "quantize_model", "row_bucket", "save",
    "shard", "shared_kv", "target_shapes", "visible_keys", "weight_bytes", "widen", "with_draft_vocab",
]
