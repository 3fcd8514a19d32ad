"""The default pair recipe's fixed parts (`python -m jaxspec.train.default_pair`): its sizes (full, smoke,
medium), the XLA determinism flag probe, the corpus and its byte-level BPE tokenizer, the two configs."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from jaxspec import models
from jaxspec.default_pair import BOS_ID, EOS_ID, PAD_ID
from jaxspec.models.config import FULL, SLIDING
from jaxspec.train import corpus as corpus_mod
from jaxspec.train.shared import log

SPECIALS = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<bos>": BOS_ID}  # the tokenizer's first ids, in this order


@dataclasses.dataclass
class Sizes:
    vocab: int
    hidden: int
    layers: int
    full_every: int
    heads: int
    kv_heads: int
    head_dim: int
    global_head_dim: int
    ffn: int
    window: int
    a_hidden: int
    a_layers: int
    a_heads: int
    a_ffn: int
    seq: int
    batch: int
    a_batch: int
    draft_steps: int          # J = K - 1 unrolled draft steps
    gen_seqs: int             # greedy continuations for the assistant's data
    gen_prompt: int           # prompt tokens of each (the rest of `seq` is generated)
    gen_batch: int
    prompt_tokens: int        # held-out eval prompts
    n_prompts: int
    eval_new_tokens: int
    val_windows: int          # held-out windows for the validation loss during training
    ppl_windows: int          # held-out windows for the final perplexities


FULL_SIZES = Sizes(vocab=4096, hidden=512, layers=12, full_every=6, heads=8, kv_heads=2, head_dim=64,
                   global_head_dim=128, ffn=1536, window=128, a_hidden=512, a_layers=1, a_heads=8, a_ffn=3072,
                   seq=256, batch=128, a_batch=64, draft_steps=3, gen_seqs=8192, gen_prompt=128, gen_batch=512,
                   prompt_tokens=48, n_prompts=20, eval_new_tokens=64, val_windows=64, ppl_windows=512)
SMOKE_SIZES = Sizes(vocab=512, hidden=64, layers=3, full_every=3, heads=4, kv_heads=2, head_dim=16,
                    global_head_dim=32, ffn=128, window=16, a_hidden=64, a_layers=2, a_heads=4, a_ffn=128,
                    seq=64, batch=8, a_batch=8, draft_steps=3, gen_seqs=32, gen_prompt=32, gen_batch=16,
                    prompt_tokens=24, n_prompts=4, eval_new_tokens=16, val_windows=8, ppl_windows=64)
# CPU-sized check of the recipe (a few minutes per phase): not shipped, for judging acceptance trends.
MEDIUM_SIZES = Sizes(vocab=2048, hidden=128, layers=4, full_every=4, heads=4, kv_heads=2, head_dim=32,
                     global_head_dim=64, ffn=384, window=64, a_hidden=128, a_layers=2, a_heads=4, a_ffn=384,
                     seq=128, batch=16, a_batch=16, draft_steps=3, gen_seqs=512, gen_prompt=64, gen_batch=128,
                     prompt_tokens=32, n_prompts=8, eval_new_tokens=32, val_windows=16, ppl_windows=64)
PRESETS = {"full": FULL_SIZES, "smoke": SMOKE_SIZES, "medium": MEDIUM_SIZES}


# ------------------------------------------------------------------------------------------------
# XLA determinism flag (probed in a subprocess: an unknown XLA flag aborts the process)


def deterministic_xla_flags(enabled: bool, environ) -> tuple[dict, str | None]:
    """-> (info for metrics.json, the XLA_FLAGS value to run with, or None to leave it as it is).
    `environ` is the process environment main() passes in; the flag is kept only if a child process
    with it runs the op kinds training uses."""
    flag = "--xla_gpu_deterministic_ops=true"
    info = {"requested": enabled, "flag": flag, "applied": False}
    if not enabled:
        return info, None
    current = environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" in current:
        info.update(applied=True, note="already in XLA_FLAGS")
        return info, None
    env = dict(environ, XLA_FLAGS=(current + " " + flag).strip())
    probe = ("import jax, jax.numpy as jnp\n"  # the op kinds training uses: gather/scatter-add, bf16 dots, softmax
             "E = jnp.linspace(-1, 1, 64 * 32, dtype=jnp.float32).reshape(64, 32); ids = jnp.arange(16) % 7\n"
             "f = lambda E: jnp.sum(jax.nn.log_softmax(jax.lax.dot_general(jnp.take(E, ids, 0).astype(jnp.bfloat16), "
             "E.astype(jnp.bfloat16), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)))\n"
             "print(jax.default_backend(), float(jax.jit(jax.grad(f))(E).sum()))")
    try:
        r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        log("WARNING: XLA flag probe timed out; running without deterministic GPU ops")
        info["note"] = "probe timed out"
        return info, None
    if r.returncode == 0:
        info.update(applied=True, probe=r.stdout.strip())
        return info, env["XLA_FLAGS"]
    log(f"WARNING: this XLA rejects {flag} (rc {r.returncode}); running without it:\n{r.stderr[-800:]}")
    info["note"] = f"rejected: {r.stderr[-300:]}"
    return info, None


# ------------------------------------------------------------------------------------------------
# Corpus and tokenizer


def load_corpus(smoke: bool, max_files: int | None):
    """(train [(name, text)], held-out [(name, text)], info): `corpus.collect` over the stdlib and
    the installed `corpus.PACKAGES` (the stdlib alone for --smoke)."""
    roots = corpus_mod.source_roots(() if smoke else corpus_mod.PACKAGES)
    train, held, info = corpus_mod.collect(roots, max_files)
    missing = [k for k, v in info["sources"].items() if v["missing"]]
    if missing:
        log(f"WARNING: corpus sources not installed here, skipped: {missing}")
    if info["train_bytes"] < 5e6 and not (smoke or max_files):
        log(f"WARNING: only {info['train_bytes'] / 1e6:.1f} MB of training text")
    return train, held, info


def train_tokenizer(texts, vocab: int):
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=sorted(SPECIALS, key=SPECIALS.get),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    for s, i in SPECIALS.items():
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    if tok.get_vocab_size() > vocab:
        raise RuntimeError(f"tokenizer vocabulary {tok.get_vocab_size()} > {vocab}")
    return tok


def encode_files(tok, texts):
    """Token id lists per file (no specials)."""
    return [e.ids for e in tok.encode_batch(texts)]


def token_stream(file_ids) -> np.ndarray:
    """The files' tokens as one int32 stream, <eos> after every file."""
    return np.concatenate([np.asarray(ids + [EOS_ID], np.int32) for ids in file_ids])


# ------------------------------------------------------------------------------------------------
# Configs


def _text_dict(s: Sizes, **fields) -> dict:
    """A gemma4_text config dict: the target's sizes and choices, `fields` replacing some. Softcapped
    logits, tied embeddings, no per-layer inputs; every field not set here (RoPE: theta 1e4 on sliding
    layers, proportional with theta 1e6 and a quarter of the dims rotated on full layers; RMSNorm eps
    1e-6; tanh GELU; K != V; no KV sharing) takes models.TargetConfig's Gemma 4 defaults.

    max_position_embeddings = seq, the context both models are trained for: the target's windows are
    seq + 1 tokens, of which it reads the first seq (positions 0..seq-1; the last token is only a
    label), the assistant's are seq tokens (drafts at positions <= seq-1), and the greedy training data
    come from a cache of seq positions. No position >= seq is ever trained, so longer contexts are
    refused (the CLI's context check) rather than run out of distribution."""
    d = dict(model_type="gemma4_text", vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
             num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
             head_dim=s.head_dim, global_head_dim=s.global_head_dim, sliding_window=s.window,
             final_logit_softcapping=30.0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
             max_position_embeddings=s.seq)
    d.update(fields)
    return d


def target_config(s: Sizes) -> models.TargetConfig:
    """Every `full_every`-th layer and the last one full attention, the others sliding."""
    types = [FULL if (i + 1) % s.full_every == 0 or i == s.layers - 1 else SLIDING for i in range(s.layers)]
    return models.TargetConfig.from_dict(_text_dict(s, layer_types=types))


def assistant_config(s: Sizes) -> models.AssistantConfig:
    """a_layers Q-only layers (sliding, then one full) over the target's K/V with the target's head
    geometry; no softcap; a tied plain head (no ordered-embeddings centroids)."""
    text = _text_dict(s, hidden_size=s.a_hidden, intermediate_size=s.a_ffn, num_hidden_layers=s.a_layers,
                      num_attention_heads=s.a_heads, layer_types=[SLIDING] * (s.a_layers - 1) + [FULL],
                      num_kv_shared_layers=s.a_layers, final_logit_softcapping=None)
    return models.AssistantConfig.from_dict(dict(model_type="gemma4_assistant", text_config=text,
                                                 backbone_hidden_size=s.hidden, use_ordered_embeddings=False))
