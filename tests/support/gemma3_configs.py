"""Tiny Gemma 3 configs (each Gemma 3 choice on in one, off in the other) and the tolerance, shared by
tests/models/test_gemma3.py (against transformers) and test_gemma3_family.py (no transformers)."""
import numpy as np

from jaxspec.kernels import DispatchConfig
from jaxspec.models.config import FULL, SLIDING

XLA = DispatchConfig(backend="xla")


S, F = SLIDING, FULL


PREFILL, DECODE = 20, 8  # prefill > ROW_TILE (blocked attention), then one token at a time


CAPACITY = 32            # > window + ROW_TILE + 1: the sliding layers keep a ring


_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
             rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=256,
             pad_token_id=0, bos_token_id=2, eos_token_id=1)


# Each Gemma 3 choice on in one config, off in the other. "base": a last layer that is sliding (HF
# keeps it; Gemma 4 forces it full), a scale query_pre_attn_scalar**-0.5 that is not a power of two,
# linear RoPE scaling on the full layer, tied head, no softcap. "pattern": layer_types absent (HF's
# 5 : 1 default), one KV head, an untied head, a final softcap that bites.
CONFIGS = {
    "base": dict(_BASE, num_hidden_layers=3, layer_types=[S, F, S], num_key_value_heads=2, sliding_window=4,
                 query_pre_attn_scalar=24, final_logit_softcapping=None, tie_word_embeddings=True,
                 rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                                  F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}),
    "pattern": dict(_BASE, num_hidden_layers=6, num_key_value_heads=1, sliding_window=3, query_pre_attn_scalar=16,
                    final_logit_softcapping=5.0, tie_word_embeddings=False),
}


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# Both sides compute in float32, in different orders (torch's matmuls and einsums vs XLA's, our
# blocked online softmax vs a full softmax): per-op relative differences ~1e-7, a few layers deep.
# 1e-4 of the largest logit leaves two orders of margin, while any Gemma 3 difference done wrong
# (norm w instead of 1 + w, scale 1 instead of 24**-0.5, a swapped RoPE base, the factor, a v norm)
# moves logits by O(1) of it.
TOL = 1e-4
