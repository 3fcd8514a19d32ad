"""Train an MTP assistant (drafter) for a target jaxspec loads, by self-distillation.

    python -m jaxspec.train.assistant --target gemma-3-270m --out DIR            # a model name, or a path
    python -m jaxspec.train.assistant --target /tmp/gemma-3-270m-q4_k_m.gguf --target-name gemma-3-270m \\
        --out "$OUT/drafter" --work /tmp/drafter-work --minutes 9.5              # one H200 call (see below)
    python -m jaxspec.train.assistant ... --resume     # continue the run in --work: its data and checkpoint

The drafter directory (--out), what `models.load_assistant(DIR, target=target)` reads:

    config.json           a gemma4_assistant config (models.AssistantConfig) plus three keys:
                          "target": the target's name ("gemma-3-270m"),
                          "target_fingerprint": models/fingerprint.py's dict of the target it was
                          trained for (architecture hash + an embedding sample; another target is
                          refused with one line),
                          "shared_embedding": "target": no embedding table of its own, its tied head
                          and its ordered-embeddings head read the target's table.
    model.safetensors     the weights in the MLX layout (models.save), 8-bit group 64 linear weights
                          (--bits), no embed_tokens; jaxspec_manifest.json is models.save's manifest.
    NOTICE                the Gemma terms' notice (a drafter distilled from Gemma is a model derivative).
    heldout_prompts.json  the held-out prompts the run measured on (text; never trained on).
    metrics.json          everything the run measured; train_log.txt its log lines.

    target = models.load_target("gemma-3-270m")
    assistant = models.load_assistant(DIR, target=target)
    out = jaxspec.generate(target, ids, assistant=assistant, block_size=4)

The recipe (generalised from the default pair's, `jaxspec.train.default_pair`; the shared pieces are
`jaxspec.train.shared`):

1. Prompts, nothing downloaded, each --prompt-tokens long (BOS first): --self-share of them written
   by the target itself (BOS, then its samples at --self-temperature, top_p 0.95: the general prose
   it was trained on, which this machine's text lacks; without them the first drafter kept 5-15% of
   its drafts on held-out stories and letters), the rest windows of Python source and of prose
   (docstrings of that source, the installed packages' METADATA descriptions) from
   `jaxspec.train.corpus` (its held-out files excluded), half code, half prose. Any text
   containing a held-out prompt is dropped first (recorded: `data.dropped_for_heldout`).
   `--random-prompts` uses random token ids instead (a target without a tokenizer; the tests).
2. The target's own greedy continuations of them (`jaxspec.generate`, classic, batched):
   --new-tokens per prompt. The labels are the target's greedy tokens, exactly what the drafter must
   predict at temperature 0. 2% of the rows are kept apart for the held-out loss.
3. A token ordering for the ordered-embeddings draft head: the target's embedding rows split into
   --centroids equal clusters by recursive bisection along each group's principal axis (a balanced
   clustering); the centroid weights start as the clusters' mean rows. A draft step scores the
   centroids, keeps the top --top-k clusters and scores only their tokens exactly, with the target's
   table: a few thousand rows instead of the whole vocabulary (`models.centroid_logits`).
4. The drafter: --layers Q-only layers of the target's width over the target's K/V, FFN --ffn,
   trained as the default pair's (one teacher forward per batch for the hidden states and K/V; K-1 =
   3 draft steps unrolled, each after the first carrying the drafter's own h_next), loss = cross-
   entropy of the exact head to the target's greedy token + cross-entropy of the centroid scores to
   that token's cluster, on the continuation positions only. AdamW, warm-up + cosine.
   Before training, the batched forward is checked against `models.draft_step` (float32).
5. Saved (8-bit) to --out, reloaded with models.load_assistant, and measured on the held-out prompts:
   greedy, K = 4, against classic decoding: tokens per round, acceptance, per-position acceptance
   (how often draft 1, 2, 3 is kept), identical output; and a draft step's cost against a target
   step (ordered head and full head).

Time: --minutes bounds this call's wall time (load, data, training, save, evaluation): the data stop
at their share, training stops --eval-reserve seconds before the end, and the evaluation starts no
held-out prompt after it. Everything reusable is cached under --work, a directory only this user can
write (default: jaxspec/drafter-work/<target name> in the user's cache; prompts, greedy
rows, token ordering, a checkpoint every --ckpt-seconds and at the end): `--resume` continues the
same run (the step count and schedule are fixed by the first call and kept in the checkpoint), and
writes the drafter when its steps are done or its time is up. The GPU machine gives a command <= 10
minutes and keeps /tmp while it stays warm, hence the single-call default below.

One H200 call (the GGUF at /tmp/gemma-3-270m-q4_k_m.gguf), the drafter written under $OUT:

    python -m jaxspec.train.assistant --target /tmp/gemma-3-270m-q4_k_m.gguf --target-name gemma-3-270m \\
        --out "$OUT/drafter" --work /tmp/drafter-work --minutes 9.5

Every mistake in the flags or the files they name is one line on stderr and exit status 2, found
before the target loads (jaxspec.train.assistant_inputs). Needs optax (`pip install -e '.[train]'`).
Importing this module computes nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.pairs import DRAFTERS  # shipped drafters: drafters/<target name>/
from jaxspec.train import shared
from jaxspec.train import assistant_inputs as inputs
from jaxspec.train.assistant_data import (balanced_ordering, corpus_texts, drop_heldout, embedding_table,  # noqa: F401
                                         greedy_rows, heldout_probes, random_prompts, self_prompts, text_prompts)
from jaxspec import models
from jaxspec.train.shared import TRAIN_MATMUL, Metrics, init_params, log, lr_at, make_tx, unrolled_hidden
from jaxspec.kernels import DispatchConfig, QuantizedWeight, dequantize
from jaxspec.models import fingerprint as fp_mod
from jaxspec.models.checkpoint import SHARED_EMBEDDING
from jaxspec.models.config import FULL, SLIDING
from jaxspec.models.gemma4 import rope_dict
from jaxspec.models.layers import linear
from jaxspec.models.params import assistant_shapes

DRAFT_STEPS = 3  # K - 1 at K = 4
NOTICE = """\
This drafter (MTP assistant) was trained by jaxspec (python -m jaxspec.train.assistant or
jaxspec.train.ttt) on text generated and scored by Gemma 3 270M, whose weights are provided under
and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms. As a model derivative of
Gemma, it is distributed under those terms, including the Gemma Prohibited Use Policy
(ai.google.dev/gemma/prohibited_use_policy). Gemma is provided under and subject to the Gemma Terms
of Use found at ai.google.dev/gemma/terms.
"""


# ------------------------------------------------------------------------------------------------
# Configuration


def assistant_config(tcfg: models.TargetConfig, layers: int, ffn: int, centroids: int, top_k: int,
                     heads: int | None = None) -> models.AssistantConfig:
    """A gemma4_assistant that drafts for `tcfg`: `layers` Q-only layers (sliding ones, the last full)
    of the TARGET's width (its tied head is the target's table), the target's head geometry and
    RoPE (the queries meet keys the target rotated), no softcap, an ordered-embeddings head of
    `centroids` clusters, `top_k` of them scored per step (centroids=0: a plain full head)."""
    full = tcfg.store_layer(FULL)
    slide = tcfg.store_layer(SLIDING)
    ref = full if full is not None else slide
    hd_s = tcfg.layer_head_dims[slide if slide is not None else ref]
    text = dict(model_type="gemma4_text", vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size,
                intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads or tcfg.num_attention_heads,
                num_key_value_heads=tcfg.layer_kv_heads[ref], head_dim=hd_s,
                global_head_dim=tcfg.layer_head_dims[ref], attention_k_eq_v=False,
                layer_types=[SLIDING] * (layers - 1) + [FULL] if full is not None else [SLIDING] * layers,
                sliding_window=tcfg.sliding_window,
                rope_parameters={SLIDING: rope_dict(tcfg.rope_sliding), FULL: rope_dict(tcfg.rope_full)},
                rms_norm_eps=tcfg.rms_norm_eps, hidden_activation=tcfg.hidden_activation,
                final_logit_softcapping=None, tie_word_embeddings=True, num_kv_shared_layers=layers,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                max_position_embeddings=tcfg.max_position_embeddings)
    return models.AssistantConfig.from_dict(dict(
        model_type="gemma4_assistant", text_config=text, backbone_hidden_size=tcfg.hidden_size,
        use_ordered_embeddings=centroids > 0, num_centroids=max(centroids, 1),
        centroid_intermediate_top_k=min(top_k, max(centroids, 1)), tie_word_embeddings=True))


def trainable_shapes(acfg) -> dict:
    """The drafter's own params (the shared table and the token ordering are not trained)."""
    return {k: v for k, v in assistant_shapes(acfg).items()
            if k not in ("embed_tokens", "masked_embedding.token_ordering")}


# ------------------------------------------------------------------------------------------------
# Training


def teacher_target(target):
    """The target on the XLA paths (training differentiates through nothing of it, but its forward
    runs inside the training step, where the Pallas attention kernels have no batched-window path)."""
    return target.replace(matmul=TRAIN_MATMUL)


def make_loss(acfg, tcfg, prompt_len: int, seq: int, dtype, cluster_weight: float):
    """loss(trainable, frozen, teacher_params, rows [B, seq]) -> (loss, aux [3 * J]): aux holds per draft
    step the full-head top-1 agreement with the target's greedy token, the centroid recall (its
    cluster among the top-k) and the token loss."""
    J = DRAFT_STEPS
    t0, t1 = prompt_len - 2, seq - J - 1  # queries whose J labels are all greedy tokens
    ordered = acfg.use_ordered_embeddings

    def loss(p, frozen, tp, rows):
        teacher = models.Target(config=tcfg, params=tp, matmul=TRAIN_MATMUL)
        cache = models.init_cache(tcfg, rows.shape[0], seq, dtype, ring=False)
        _, hidden, cache = models.forward(teacher, rows, cache)  # the logits are dead code
        hidden, cache = jax.lax.stop_gradient((hidden, cache))
        ap = dict(shared.to_dtype(p, dtype), embed_tokens=frozen["embed_tokens"])
        hns = unrolled_hidden(acfg, tcfg, ap, tp, rows, hidden, cache, J)
        total, aux = 0.0, []
        for j, hn in enumerate(hns):
            hn = hn[:, t0:t1]
            lab = rows[:, t0 + 2 + j:t1 + 2 + j]
            lg = linear(hn, frozen["embed_tokens"], TRAIN_MATMUL).astype(jnp.float32)
            tok_ce = jnp.mean(jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, lab[..., None], -1)[..., 0])
            acc = jnp.mean((jnp.argmax(lg, -1) == lab).astype(jnp.float32))
            total = total + tok_ce
            if ordered:
                cl = linear(hn, ap["masked_embedding.centroids"], TRAIN_MATMUL).astype(jnp.float32)
                cl_lab = frozen["cluster_of"][lab]
                cl_ce = jnp.mean(jax.nn.logsumexp(cl, -1) - jnp.take_along_axis(cl, cl_lab[..., None], -1)[..., 0])
                total = total + cluster_weight * cl_ce
                kth = jax.lax.top_k(cl, acfg.centroid_intermediate_top_k)[0][..., -1]
                recall = jnp.mean((jnp.take_along_axis(cl, cl_lab[..., None], -1)[..., 0] >= kth).astype(jnp.float32))
            else:
                recall = jnp.float32(1.0)
            aux += [acc, recall, tok_ce]
        return total / J, jnp.stack(aux)

    return loss


def _flat(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def save_checkpoint(path: str, state: dict) -> None:
    """Params, optimizer state and counters as one .npz, replaced atomically."""
    arrays = {f"p{i}": a for i, a in enumerate(_flat(state["p"]))}
    arrays.update({f"o{i}": a for i, a in enumerate(_flat(state["o"]))})
    arrays["meta"] = np.asarray(json.dumps({k: state[k] for k in ("step", "total", "history", "evals")}))
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def load_checkpoint(path: str, p_like, o_like) -> dict:
    """save_checkpoint's state, its arrays checked against the run's (`p_like`, `o_like`): ValueError
    for a checkpoint of another drafter (another --ffn, --layers, ...)."""
    z = np.load(path, allow_pickle=False)
    meta = json.loads(str(z["meta"]))
    pl, pt = jax.tree.flatten(p_like)
    ol, ot = jax.tree.flatten(o_like)
    want = {f"p{i}": x for i, x in enumerate(pl)} | {f"o{i}": x for i, x in enumerate(ol)}
    if set(z.files) != set(want) | {"meta"}:
        raise ValueError(f"it holds {len(z.files) - 1} arrays, the run's drafter and optimizer {len(want)}")
    got = {k: z[k] for k in want}
    for k, x in want.items():
        if got[k].shape != x.shape or got[k].dtype != x.dtype:
            raise ValueError(f"array {k} is {got[k].dtype} {got[k].shape}, the run's is {x.dtype} {x.shape}")
    p = jax.tree.unflatten(pt, [jnp.asarray(got[f"p{i}"]) for i in range(len(pl))])
    o = jax.tree.unflatten(ot, [jnp.asarray(got[f"o{i}"]) for i in range(len(ol))])
    return dict(p=p, o=o, **meta)


def to_assistant(acfg, params: dict, frozen: dict, ordering, dtype, matmul=None) -> models.Assistant:
    """The drafter as the loop runs it: trained params cast to `dtype`, the shared table, the ordering."""
    p = shared.to_dtype(params, dtype)
    p["embed_tokens"] = frozen["embed_tokens"]
    if acfg.use_ordered_embeddings:
        p["masked_embedding.token_ordering"] = jnp.asarray(ordering, jnp.int32)
    return models.make_assistant(acfg, p, matmul)


def save_drafter(out: str, assistant: models.Assistant, target, target_name: str, bits: int) -> dict:
    """models.save (linear weights quantized to `bits`, no embedding table) with its NOTICE, switched in
    together; -> file sizes."""
    os.makedirs(out, exist_ok=True)
    model = assistant
    if bits:
        own = {k: v for k, v in assistant.params.items() if k != "embed_tokens"}
        q = models.quantize_model(assistant.replace(params=own), bits=bits, group_size=64)
        model = q.replace(params=dict(q.params, embed_tokens=assistant.params["embed_tokens"]))

    def notice(directory):
        with open(os.path.join(directory, "NOTICE"), "w") as f:
            f.write(NOTICE)
    models.save(model, out, config_extra={"target": target_name, "target_fingerprint": fp_mod.target_fingerprint(target),
                                          "shared_embedding": SHARED_EMBEDDING}, extra_files=notice)
    return {fn: os.path.getsize(os.path.join(out, fn)) for fn in sorted(os.listdir(out))
            if os.path.isfile(os.path.join(out, fn))}


# ------------------------------------------------------------------------------------------------
# Evaluation


def acceptance_stats(target, assistant, prompts, new_tokens: int, block_size: int = 4, eos=None,
                     end_by: float | None = None) -> dict:
    """Greedy speculative decoding of every prompt against classic: tokens per round, acceptance,
    per-position acceptance (share of rounds keeping draft i), identical outputs, decode times.
    `end_by` (time.time()): no prompt is started after it (`skipped_for_time` counts those left)."""
    tot = dict(drafted=0, accepted=0, rounds=0, new=0, identical=0, cls_s=0.0, spec_s=0.0)
    # one cache size for every prompt: a program per prompt-length bucket, not per prompt
    cache = -(-max(len(x) for x in prompts) // 16) * 16 + new_tokens + 2 * block_size
    hist = np.zeros(block_size, np.int64)
    per = []
    for ids in prompts:
        if end_by is not None and time.time() > end_by:
            break
        c = jaxspec.generate(target, list(ids), max_new_tokens=new_tokens, block_size=1, eos_token_ids=eos,
                             cache_size=cache)
        s = jaxspec.generate(target, list(ids), assistant=assistant, max_new_tokens=new_tokens,
                             block_size=block_size, eos_token_ids=eos, cache_size=cache)
        st = s.stats
        same = c.tokens[0] == s.tokens[0]
        tot["identical"] += int(same)
        tot["drafted"] += st.drafted
        tot["accepted"] += st.accepted
        tot["rounds"] += st.row_rounds
        tot["new"] += len(s.tokens[0]) - 1  # the prefill's token is no round's
        tot["cls_s"] += c.stats.decode_s
        tot["spec_s"] += st.decode_s
        h = np.asarray(st.accepted_hist[:block_size])
        hist[:len(h)] += h
        per.append(dict(tokens_per_round=round(st.tokens_per_round, 3), acceptance=round(st.acceptance_rate, 3),
                        identical=bool(same), mode=st.mode))
    rounds = max(1, tot["rounds"])
    kept = [float(hist[i + 1:].sum() / max(1, hist.sum())) for i in range(block_size - 1)]
    return dict(prompts=len(per), skipped_for_time=len(prompts) - len(per), block_size=block_size,
                new_tokens=new_tokens,
                tokens_per_round=round(tot["new"] / rounds, 3),
                acceptance_rate=round(tot["accepted"] / max(1, tot["drafted"]), 4),
                per_position_acceptance=[round(x, 3) for x in kept], accepted_hist=hist.tolist(),
                identical=f"{tot['identical']}/{len(per)}", all_identical=tot["identical"] == len(per),
                classic_decode_s=round(tot["cls_s"], 3), speculative_decode_s=round(tot["spec_s"], 3),
                speedup=round(tot["cls_s"] / tot["spec_s"], 3) if tot["spec_s"] else None, per_prompt=per)


def step_costs(target, assistant, context: int = 128, reps: int = 30) -> dict:
    """Milliseconds of one jitted target decode step [1, 1] and one draft step (the ordered head and
    the same drafter with a full head over the whole vocabulary), batch 1, after `context` tokens."""
    tcfg = target.config
    cache = models.init_cache(tcfg, 1, context + 8, target.dtype)
    _, hidden, cache = jax.jit(models.forward)(target, jnp.full((1, context), 5, jnp.int32), cache)
    tok, h, pos = jnp.asarray([7], jnp.int32), hidden[:, -1], cache.lengths

    def timed(fn, *a):
        jax.block_until_ready(fn(*a))
        t = time.perf_counter()
        for _ in range(reps):
            r = fn(*a)
        jax.block_until_ready(r)
        return (time.perf_counter() - t) / reps * 1e3

    step = jax.jit(lambda t, x, c: models.forward(t, x, c)[0])
    draft = jax.jit(lambda a, t, c, x, hh, p: models.draft_step(a, t, c, x, hh, p)[0])
    out = dict(target_step_ms=timed(step, target, tok[:, None], cache),
               draft_step_ms=timed(draft, assistant, target, cache, tok, h, pos))
    if assistant.config.use_ordered_embeddings:
        plain = assistant.replace(config=dataclasses.replace(assistant.config, use_ordered_embeddings=False))
        out["draft_step_full_head_ms"] = timed(draft, plain, target, cache, tok, h, pos)
    out = {k: round(v, 3) for k, v in out.items()}
    out["draft_over_target"] = round(out["draft_step_ms"] / out["target_step_ms"], 3)
    out["device"] = str(jax.devices()[0])
    return out


# ------------------------------------------------------------------------------------------------
# Main


PROG = "python -m jaxspec.train.assistant"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the whole usage (argparse prints ~40 lines of it)
        raise inputs.UsageError(f"{message} (--help lists the flags)")


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0],
                epilog=__doc__[__doc__.index("One H200 call"):__doc__.index("Needs optax")],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target: a model name (gemma-3-270m), a .gguf or a checkpoint dir")
    p.add_argument("--target-name", default=None,
                   help="the name recorded in the drafter's config (default: --target when it is a model name, "
                        "else the file or directory name)")
    p.add_argument("--out", required=True, help="the drafter directory to write")
    p.add_argument("--work", default=None, help="cache of prompts, greedy rows, ordering and checkpoints: a "
                   "directory of yours that only you can write (default: jaxspec/drafter-work/<target name> in "
                   "$XDG_CACHE_HOME or ~/.cache, made 0700)")
    p.add_argument("--resume", action="store_true", help="continue the run cached in --work")
    p.add_argument("--minutes", type=float, default=9.5,
                   help="wall-time budget of this whole call: data, training, save and evaluation (> 0)")
    p.add_argument("--eval-reserve", type=float, default=None, help="seconds kept for save + eval (GPU 120, CPU 240)")
    p.add_argument("--heldout", default=None, help="held-out prompts JSON (default: drafters/<name>/heldout_prompts.json)")
    p.add_argument("--random-prompts", action="store_true", help="random token prompts (no tokenizer needed)")
    p.add_argument("--prompts", type=int, default=None, help="training prompts / greedy rows (GPU 24576, CPU 64)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    p.add_argument("--self-share", type=float, default=0.5,
                   help="share of the prompts the target writes itself (sampled from BOS; the rest from the corpus)")
    p.add_argument("--self-temperature", type=float, default=1.0, help="temperature of the self-written prompts")
    p.add_argument("--gen-batch", type=int, default=None, help="rows per greedy generation call (GPU 512, CPU 16)")
    p.add_argument("--gen-seconds", type=float, default=120.0, help="cap on the greedy generation's time")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--centroids", type=int, default=2048, help="ordered-embeddings clusters (0: a full head)")
    p.add_argument("--top-k", type=int, default=32, help="clusters scored exactly per draft step")
    p.add_argument("--batch", type=int, default=None, help="rows per training step (GPU 32, CPU 2)")
    p.add_argument("--steps", type=int, default=None, help="total steps (default: calibrated to the time left)")
    p.add_argument("--train-minutes", type=float, default=None,
                   help="training time the step count is calibrated to, over this call and --resume calls "
                        "(default: what this call has left)")
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--stop-after", type=int, default=None,
                   help="this call trains at most N steps, then checkpoints and writes the drafter (--resume goes on)")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--cluster-weight", type=float, default=1.0, help="weight of the centroid loss")
    p.add_argument("--ckpt-seconds", type=float, default=90.0)
    p.add_argument("--bits", type=int, default=8, choices=(0, 4, 8), help="saved linear weights (0: bf16)")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts measured (default all)")
    p.add_argument("--eval-new-tokens", type=int, default=64)
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--no-self-check", action="store_true",
                   help="skip the float32 check of the batched training forward against models.draft_step (its "
                        "three float32 compiles take ~100 s on the H200; tests/train/test_train_assistant.py runs it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=None, help="corpus files per source (a quick run)")
    return p


def target_name_of(arg: str, given: str | None) -> str:
    if given:
        return given
    from jaxspec.models import gguf
    if arg in gguf.KNOWN and not os.path.exists(arg):
        return arg
    base = os.path.basename(os.path.normpath(arg))
    return base[:-5] if base.endswith(".gguf") else base


def load_heldout(path: str | None, name: str) -> tuple[list[dict], str | None]:
    """(the held-out prompts, their file): --heldout, else drafters/<name>/heldout_prompts.json if
    there is one (else none: random prompts); UsageError for a file that is not such a list."""
    return inputs.load_heldout(path, os.path.join(DRAFTERS, name, "heldout_prompts.json"))


class _Tee:
    """stdout also into a file (the run's log comes back with --out)."""

    def __init__(self, stream, path):
        self.stream, self.f = stream, open(path, "a")

    def write(self, s):
        self.stream.write(s)
        self.f.write(s)
        self.f.flush()

    def flush(self):
        self.stream.flush()


def main(argv=None) -> int:
    """The run (module docstring); a mistake in the flags or the files they name is one line on
    stderr and exit status 2, found before anything heavy runs (jaxspec.train.assistant_inputs)."""
    stdout = sys.stdout
    try:
        return _run(argv)
    except inputs.UsageError as e:
        print(f"{PROG}: error: {inputs.one_line(e)}", file=sys.stderr, flush=True)
        return 2
    finally:
        if isinstance(sys.stdout, _Tee):
            sys.stdout.f.close()
        sys.stdout = stdout


def _checked(args, on_gpu: bool) -> tuple[str, str, models.TargetConfig, float]:
    """Every check before the run starts (inputs): (the target's name, the work folder, its config,
    the evaluation's reserve in seconds); a resumed run's recipe and the device's defaults set on
    `args`."""
    name = target_name_of(args.target, args.target_name)
    inputs.check_name(name)
    work = args.work or inputs.default_work(name)
    inputs.check_work(work, args.resume)
    if args.resume:  # the first call's recipe, not this one's flags
        parser = build_parser()
        inputs.read_run(work, args, {k: parser.get_default(k) for k in vars(args)})
    defaults = dict(prompts=24576 if on_gpu else 64, gen_batch=512 if on_gpu else 16, batch=32 if on_gpu else 2)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    inputs.check_flags(args)
    tcfg = inputs.target_config(args.target)
    reserve = 0.0 if args.no_eval else (args.eval_reserve if args.eval_reserve is not None else
                                        120.0 if on_gpu else 240.0)
    inputs.check_recipe(args, tcfg, reserve)
    try:
        assistant_config(tcfg, args.layers, args.ffn, args.centroids, args.top_k)
    except ValueError as e:
        raise inputs.UsageError(f"the drafter these flags ask for is not valid: {inputs.one_line(e, 300)}") from None
    inputs.check_out(args.out)
    if args.resume:
        inputs.check_cached(work, args.prompt_tokens + args.new_tokens)
    return name, work, tcfg, reserve


def _run(argv) -> int:
    start = shared.reset_clock()
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    name, work, _, reserve = _checked(args, on_gpu)
    heldout, held_path = load_heldout(args.heldout, name)
    cached = args.resume and os.path.isfile(os.path.join(work, "data.npz"))
    tok = inputs.tokenizer_of(args.target) if heldout and not args.random_prompts and not cached else None
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise inputs.UsageError(f"--out {args.out!r} cannot be made: {e.strerror or e}") from None
    inputs.prepare_work(work, args.resume)
    sys.stdout = _Tee(sys.stdout, os.path.join(args.out, "train_log.txt"))
    end = start + 60.0 * args.minutes  # the whole call: data, training, save and evaluation
    end_train = end - reserve - inputs.AFTER_TRAIN_S
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    metrics = Metrics(os.path.join(args.out, "metrics.json"), keep=args.resume)
    run_path = os.path.join(work, inputs.RUN)
    if not args.resume:
        with open(run_path, "w") as f:
            json.dump(dict(args=vars(args), target=name), f, indent=1)
    log(f"train_assistant: target {args.target!r} ({name}) on {jax.devices()[0]}, work {work}, out {args.out}, "
        f"{args.minutes} min{' (resume)' if args.resume else ''}")
    metrics.set("run", dict(args=vars(args), device=str(jax.devices()[0]), jax=jax.__version__,
                            python=sys.version.split()[0]))

    t = time.time()
    # The stored (quantized) weights: the teacher's forward runs inside the training step, and a CPU's
    # dense weights (the inference loaders' default there) are for decoding, not for differentiating around.
    target = models.load_target(args.target, dtype=dtype, matmul=DispatchConfig.from_env(backend="auto", dense=False))
    tcfg = target.config
    log(f"target loaded in {time.time() - t:.1f}s: {tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, "
        f"vocab {tcfg.vocab_size}")
    acfg = assistant_config(tcfg, args.layers, args.ffn, args.centroids, args.top_k)

    # ---- prompts and greedy rows (cached) ----------------------------------------------------------
    data_path = os.path.join(work, "data.npz")
    if os.path.isfile(data_path):
        z = np.load(data_path)
        rows, eval_prompts = z["rows"], [list(map(int, r)) for r in json.loads(str(z["eval_prompts"]))]
        log(f"data: {rows.shape[0]} cached rows of {rows.shape[1]} tokens")
    else:
        t = time.time()
        data_end = min(end_train - 60.0, t + args.gen_seconds)  # the data's share of the budget, at most
        P = args.prompt_tokens
        if args.random_prompts or not heldout:
            eval_prompts = [list(map(int, r)) for r in random_prompts(tcfg.vocab_size, args.eval_prompts or 8, P,
                                                                       args.seed + 1)]
            prompts = random_prompts(tcfg.vocab_size, args.prompts, P, args.seed, avoid=np.asarray(eval_prompts))
            info = dict(source="random token ids", heldout="random token prompts, removed from training")
        else:
            eval_prompts = [tok.encode(p["text"]) for p in heldout]
            code, prose, info = corpus_texts(args.max_files)
            probes = heldout_probes(heldout)
            code, d1 = drop_heldout(code, probes)
            prose, d2 = drop_heldout(prose, probes)
            info.update(dropped_for_heldout=d1 + d2, heldout_file=os.path.relpath(held_path, os.path.dirname(DRAFTERS)),
                        source="windows of corpus code and prose (docstrings, METADATA), half each")
            n_self = int(round(args.self_share * args.prompts / args.gen_batch)) * args.gen_batch
            prompts = text_prompts(tok, code, prose, args.prompts - n_self, P, args.seed)
            log(f"prompts: {len(prompts)} x {P} tokens from {len(code)} code / {len(prose)} prose texts; "
                f"{len(d1) + len(d2)} texts dropped as containing a held-out prompt ({time.time() - t:.1f}s)")
            if n_self:
                t = time.time()
                own = self_prompts(target, tok.encode("")[0], n_self, P, args.gen_batch, args.self_temperature,
                                   args.seed, bad_ids=(0, *tok.eos_token_ids), end_by=data_end)
                kept, d3 = drop_heldout([(i, tok.decode(r)) for i, r in enumerate(own)], probes)
                keep = [i for i, _ in kept]
                prompts = np.concatenate([prompts, own[keep]])
                info.update(self_written=dict(prompts=len(keep), temperature=args.self_temperature, top_p=0.95,
                                              dropped_for_heldout=len(d3)))
                log(f"prompts: {len(keep)} x {P} tokens written by the target (temperature "
                    f"{args.self_temperature}, top_p 0.95; {len(d3)} dropped as containing a held-out prompt) "
                    f"({time.time() - t:.1f}s)")
            info["source"] = (f"windows of corpus code and prose (docstrings, METADATA), half each, and "
                              f"{args.self_share:.0%} of the prompts written by the target itself")
            # mixed, so the held-out loss's rows (the last ones) hold every kind
            prompts = prompts[np.random.default_rng(args.seed + 2).permutation(len(prompts))]
        t = time.time()
        rows = greedy_rows(target, prompts, args.new_tokens, args.gen_batch, data_end)
        gen_s = time.time() - t
        log(f"greedy data: {rows.shape[0]} rows of {rows.shape[1]} tokens in {gen_s:.1f}s")
        np.savez(data_path, rows=rows, eval_prompts=np.asarray(json.dumps(eval_prompts)))
        metrics.set("data", dict(info, rows=int(rows.shape[0]), prompt_tokens=P, new_tokens=args.new_tokens,
                                 seconds=round(gen_s, 1), gen_batch=args.gen_batch))
    seq = rows.shape[1]
    n_val = max(2 * args.batch, rows.shape[0] // 50)
    if rows.shape[0] - n_val < args.batch:  # the time ran out before enough rows were generated
        raise inputs.UsageError(f"only {rows.shape[0]} greedy rows were generated in the time given (--minutes "
                                f"{args.minutes:g}, --gen-seconds {args.gen_seconds:g}): fewer than --batch "
                                f"{args.batch} beside the {n_val} held out; give the run more time")
    train_rows, val_rows = jnp.asarray(rows[:-n_val]), jnp.asarray(rows[-n_val:][:4 * args.batch])

    # ---- token ordering (cached) ---------------------------------------------------------------------
    frozen = {}
    table = target.params["embed_tokens"]
    frozen["embed_tokens"] = (dequantize(table, dtype) if isinstance(table, QuantizedWeight)
                              else table.astype(dtype))
    ordering = None
    ord_path = os.path.join(work, "ordering.npz")
    if acfg.use_ordered_embeddings:
        if os.path.isfile(ord_path):
            z = np.load(ord_path)
            ordering, cents = z["ordering"], z["centroids"]
        else:
            t = time.time()
            ordering, cents = balanced_ordering(embedding_table(target), acfg.num_centroids, seed=args.seed)
            np.savez(ord_path, ordering=ordering, centroids=cents)
            log(f"token ordering: {acfg.num_centroids} balanced clusters of {acfg.vocab_size // acfg.num_centroids} "
                f"in {time.time() - t:.1f}s")
        cluster_of = np.empty(acfg.vocab_size, np.int32)
        cluster_of[ordering] = np.arange(acfg.vocab_size, dtype=np.int32) // (acfg.vocab_size // acfg.num_centroids)
        frozen["cluster_of"] = jnp.asarray(cluster_of)

    # ---- training -------------------------------------------------------------------------------------
    key = jax.random.PRNGKey(args.seed)
    p0 = init_params(trainable_shapes(acfg), jax.random.fold_in(key, 1), acfg.text.num_hidden_layers)
    if acfg.use_ordered_embeddings:
        c = jnp.asarray(cents)
        p0["masked_embedding.centroids"] = c / jnp.sqrt(jnp.mean(c * c) + 1e-12) * 0.02
    tx = make_tx(args.weight_decay, p0)
    tp = teacher_target(target).params
    loss_fn = make_loss(acfg, tcfg, args.prompt_tokens, seq, dtype, args.cluster_weight)

    # the batched training forward must be what the loop runs (float32, a short row)
    diff = None
    if args.no_self_check:
        log("self-check skipped (--no-self-check)")
    else:
        t = time.time()
        check_len = min(seq, args.prompt_tokens + 24)
        ap32 = dict(shared.to_dtype(p0, jnp.float32), embed_tokens=target.params["embed_tokens"])
        if acfg.use_ordered_embeddings:
            ap32["masked_embedding.token_ordering"] = jnp.asarray(ordering)
        tp32 = shared.to_dtype(target.params, jnp.float32) if dtype != jnp.float32 else target.params
        with jax.default_matmul_precision("highest"):  # float32 for real on a GPU too (no TF32)
            diff = shared.self_check(acfg, tcfg, ap32, tp32, rows[0, :check_len], DRAFT_STEPS)
        log(f"self-check: batched training forward vs models.draft_step, max |logit diff| {diff:.2e} (f32, "
            f"{time.time() - t:.1f}s)")
        if not diff < 1e-2:
            raise RuntimeError(f"the training-time drafter forward disagrees with models.draft_step "
                               f"(max |diff| {diff:.3g})")
        del tp32, ap32

    @jax.jit  # the big arrays are arguments, not constants baked into the program
    def train_step(p, o, frozen, tp, rows_all, step, lr):
        k = jax.random.fold_in(jax.random.fold_in(key, 2), step)
        idx = jax.random.randint(k, (args.batch,), 0, rows_all.shape[0])
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(p, frozen, tp, rows_all[idx])
        u, o = tx.update(g, o, p)
        return jax.tree.map(lambda w, d: w - lr * d, p, u), o, loss, aux

    val_jit = jax.jit(loss_fn)

    def val_loss(p):
        return val_jit(p, frozen, tp, val_rows)

    ck_path = os.path.join(work, "ckpt.npz")
    if args.resume and os.path.isfile(ck_path):
        try:
            st = load_checkpoint(ck_path, p0, tx.init(p0))
        except Exception as e:  # a cut file, or another recipe's drafter: numpy's, zipfile's or JAX's error
            raise inputs.damaged(ck_path, e) from None
        log(f"resumed at step {st['step']}/{st['total']}")
    else:
        st = dict(p=p0, o=tx.init(p0), step=0, total=args.steps, history=[], evals=[])
    v0 = val_loss(st["p"])
    if not st["evals"]:
        st["evals"].append((0, float(v0[0])))
    log(f"held-out loss at step {st['step']}: {float(v0[0]):.4f} (top-1 per draft step "
        f"{' '.join(f'{float(x):.3f}' for x in v0[1][0::3])})")

    def one(step, total):
        lr = lr_at(step, total, args.lr, args.warmup)
        st["p"], st["o"], loss, aux = train_step(st["p"], st["o"], frozen, tp, train_rows, jnp.int32(step),
                                                 jnp.float32(lr))
        return loss, aux

    def finite(loss) -> float:
        """The loss as read (where the loop reads it anyway); a diverged run stops here, unsaved."""
        value = float(loss)
        if not math.isfinite(value):
            raise inputs.UsageError(f"training diverged: the loss is {value} at step {st['step']} (--lr {args.lr:g}: "
                                    "lower it)")
        return value

    t = time.time()
    if st["total"] is None or st["step"] < st["total"]:  # (a finished run resumed trains no more)
        loss, aux = one(st["step"], st["total"] or 10 ** 6)
        st["step"] += 1
        log(f"train step compiled + run in {time.time() - t:.1f}s, loss {finite(loss):.4f}")
    if st["total"] is None:  # calibrate the step count to the time left (once: kept in the checkpoint)
        t = time.time()
        n = min(10, max(1, args.warmup - 1))
        for _ in range(n):
            loss, aux = one(st["step"], 10 ** 6)
            st["step"] += 1
        loss = finite(loss)
        step_s = (time.time() - t) / n
        budget = 60.0 * args.train_minutes if args.train_minutes else end_train - time.time()
        st["total"] = int(min(args.max_steps, max(st["step"], st["step"] + budget * 0.95 / step_s)))
        log(f"{step_s * 1e3:.1f} ms/step -> {st['total']} steps")
    total = st["total"]
    t_train, last_ck, last_log, steps0 = time.time(), time.time(), time.time(), st["step"]
    cut = False
    stop_at = total if args.stop_after is None else min(total, steps0 + args.stop_after)
    while st["step"] < stop_at:
        if time.time() > end_train:
            cut = True
            break
        loss, aux = one(st["step"], total)
        st["step"] += 1
        if st["step"] % 50 == 0 or st["step"] == total:
            lv = finite(loss)
            st["history"].append((st["step"], lv))
            if time.time() - last_log > 10 or st["step"] == total:
                rate = (st["step"] - steps0) / max(1e-9, time.time() - t_train)
                a = np.asarray(aux)
                log(f"step {st['step']}/{total} loss {lv:.4f} top-1 {' '.join(f'{x:.3f}' for x in a[0::3])} "
                    f"recall {' '.join(f'{x:.3f}' for x in a[1::3])} {rate:.2f} steps/s")
                last_log = time.time()
            if st["step"] % 500 == 0:
                v = val_loss(st["p"])
                st["evals"].append((st["step"], float(v[0])))
                log(f"held-out loss at step {st['step']}: {float(v[0]):.4f}")
        if time.time() - last_ck > args.ckpt_seconds:
            save_checkpoint(ck_path, st)
            last_ck = time.time()
    v = val_loss(st["p"])
    if st["evals"][-1][0] != st["step"]:
        st["evals"].append((st["step"], float(v[0])))
    save_checkpoint(ck_path, st)
    a = np.asarray(v[1])
    cut = cut or st["step"] < total
    log(f"training: step {st['step']}/{total}{' (stopped: --resume continues)' if cut else ''}; held-out loss "
        f"{st['evals'][0][1]:.4f} -> {float(v[0]):.4f}, top-1 per draft step {' '.join(f'{x:.3f}' for x in a[0::3])}, "
        f"centroid recall {' '.join(f'{x:.3f}' for x in a[1::3])}")
    metrics.set("training", dict(
        steps=st["step"], planned_steps=total, finished=st["step"] >= total, batch=args.batch, seq=seq,
        prompt_tokens=args.prompt_tokens, lr=args.lr, warmup=args.warmup, draft_steps_unrolled=DRAFT_STEPS,
        layers=args.layers, ffn=args.ffn, centroids=args.centroids, top_k=args.top_k,
        params=int(sum(np.prod(s) for s, _ in trainable_shapes(acfg).values())),
        heldout_loss=st["evals"], loss_history=st["history"][-200:], self_check_max_abs_diff=diff,
        heldout_top1_per_step=a[0::3].tolist(), heldout_centroid_recall_per_step=a[1::3].tolist(),
        train_seconds_this_call=round(time.time() - t_train, 1)))

    # ---- save -----------------------------------------------------------------------------------------
    t = time.time()
    drafter = to_assistant(acfg, st["p"], {"embed_tokens": target.params["embed_tokens"]}, ordering,
                           jnp.bfloat16)
    files = save_drafter(args.out, drafter, target, name, args.bits)
    if heldout:
        with open(os.path.join(args.out, "heldout_prompts.json"), "w") as f:
            json.dump(dict(prompts=heldout), f, indent=1, ensure_ascii=False)
    metrics.set("files", files)
    log(f"saved the drafter to {args.out} in {time.time() - t:.1f}s: " + ", ".join(f"{k} {v / 2**20:.2f} MiB"
                                                                                   for k, v in files.items()))
    if args.no_eval:
        return 0
    if time.time() > end - 10.0:  # --minutes bounds the whole call: no evaluation past it
        log(f"no time left to evaluate (--minutes {args.minutes:g}); done in {time.time() - start:.1f}s")
        metrics.set("eval_skipped", "no time left (--minutes)")
        return 0

    # ---- evaluate what was saved (held-out prompts measured while --minutes lasts) --------------------
    errors = 0
    try:
        t = time.time()
        loaded = models.load_assistant(args.out, target=target, dtype=dtype)
        ev = metrics.d.get("eval", {})
        ev["step_costs"] = step_costs(target, loaded)
        log(f"step costs: {ev['step_costs']}")
        metrics.set("eval", ev)
        n = args.eval_prompts or len(eval_prompts)
        ev["heldout"] = acceptance_stats(target, loaded, eval_prompts[:n], args.eval_new_tokens, end_by=end)
        h = ev["heldout"]
        cut = f" (time was up for {h['skipped_for_time']} more)" if h["skipped_for_time"] else ""
        log(f"held-out, greedy K=4, {h['prompts']} prompts x {h['new_tokens']} tokens{cut}: tokens/round "
            f"{h['tokens_per_round']}, acceptance {h['acceptance_rate']}, per position {h['per_position_acceptance']}, "
            f"identical {h['identical']}, speedup {h['speedup']} ({time.time() - t:.1f}s)")
        metrics.set("eval", ev)
    except Exception as e:  # the drafter is saved: report and exit 1
        traceback.print_exc()
        metrics.set("eval_error", f"{type(e).__name__}: {e}")
        errors += 1
    log(f"done in {time.time() - start:.1f}s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
