"""Build on-policy data for the drafter: prompts of several kinds, continued by the target itself.

    python -m jaxspec.train.onpolicy_data --target gemma-3-270m --work DIR            # full size (a GPU)
    python -m jaxspec.train.onpolicy_data --target DIR_OR_GGUF --work DIR --prompts 64 --gen-batch 16  # smoke
    python -m jaxspec.train.onpolicy_data --write-heldout FILE --target gemma-3-270m   # once, on a machine with /usr/share

Prompts (`jaxspec.train.onpolicy_sources`): --prompt-tokens-long windows of standard-library and
site-packages code, their docstrings and site-packages docs, package READMEs, bullet/numbered lists,
and dialogue the target writes itself from short openers, in equal shares; held-out prompts (--heldout, default
`jaxspec/data/drafters/<target>/heldout_onpolicy.json`) come from sources training never reads, and
any training text holding a piece of one is dropped. `--random-prompts`: random token ids instead (a
target without a tokenizer: the tests).

Continuations: the target's own, --new-tokens each (`jaxspec.generate`, classic): the held-out
prompts' greedy continuations first, every one (for the trimmed vocabulary's coverage and the
evaluation, never trained on), then --gen-batch training rows at a time, --sampled-share of the
batches sampled (--temperature, top_p 0.95), the rest greedy, interleaved. Each batch is scored by
the target at once and the k (--top-logits) most likely tokens of each continuation position are
kept with their log-probabilities: the KL targets of `jaxspec.train.ttt`, small on disk.

Writes into --work (a directory of yours): data.npz (rows int32 [n, P + T], top_ids int32 [n, T, k],
top_lp float16 [n, T, k], kind int8 [n] (index into info.json's kinds), sampled bool [n],
heldout_rows int32 [m, P + T] (a prompt shorter than P right-padded with 0, its continuation at P),
heldout_lengths int32 [m] (each held-out prompt's length), counts int64 [V]: how often the target
wrote each token in the training continuations, the trimmed vocabulary's ranking) and info.json
(sources, sizes, times). --minutes bounds the whole call: a batch starts only if the last one's
time still fits (the end keeps up to 30 s for writing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec import models
from jaxspec.kernels import DispatchConfig
from jaxspec.pairs import DRAFTERS  # shipped drafters: drafters/<target name>/
from jaxspec.train import assistant_inputs as inputs
from jaxspec.train import onpolicy_sources as sources
from jaxspec.train.assistant_data import drop_heldout, heldout_probes, random_prompts
from jaxspec.train.shared import log, reset_clock

PROG = "python -m jaxspec.train.onpolicy_data"
HELDOUT_FILE = "heldout_onpolicy.json"
KINDS = sources.TRAIN_KINDS


def windows(tok, texts, n: int, length: int, rng, flat: bool) -> list[list[int]]:
    """n token windows of `length` (BOS first) at random line starts of random texts."""
    out, tries = [], 0
    while len(out) < n and tries < 50 * n + 100:
        tries += 1
        _, text = texts[rng.integers(len(texts))]
        start = int(rng.integers(0, max(1, len(text) - 200)))
        cut = text.find("\n", start)
        start = start if cut < 0 else cut + 1
        snippet = text[start:start + 8 * length]
        if flat:
            snippet = " ".join(snippet.split())
        ids = tok.encode(snippet)
        if len(ids) >= length and len(snippet.strip()) > 40:
            out.append(ids[:length])
    return out


def dialogue_prompts(target, tok, n: int, length: int, batch: int, seed: int, end_by: float) -> list[list[int]]:
    """n prompts: an opener, then the target's own samples (temperature 1, top_p 0.95) up to `length`."""
    out, call = [], 0
    openers = [tok.encode(t) for t in sources.DIALOGUE_OPENERS]
    while len(out) < n and (not out or time.time() < end_by):
        part = [openers[(call * batch + i) % len(openers)] for i in range(batch)]
        r = jaxspec.generate(target, part, max_new_tokens=length, block_size=1, eos_token_ids=[],
                             temperature=1.0, top_p=0.95, seed=seed + call)
        out += [(o + g)[:length] for o, g in zip(part, r.tokens)]
        call += 1
    return out[:n]


def heldout_ids(tok, heldout: list[dict], length: int) -> list[list[int]]:
    """The held-out prompts' token ids, each cut to `length` (the written ones are shorter and kept
    whole): what training's evaluations and `benchmarks/drafter_heldout_bench.py` run."""
    return [tok.encode(h["text"])[:length] for h in heldout]


def build_prompts(args, target, tok, heldout, end_by: float):
    """(train prompts int32 [n, P], kind [n], held-out prompts [m, P], info)."""
    p, rng = args.prompt_tokens, np.random.default_rng(args.seed)
    if args.random_prompts or tok is None:
        held = random_prompts(target.config.vocab_size, args.heldout_prompts, p, args.seed + 1)
        train = random_prompts(target.config.vocab_size, args.prompts, p, args.seed, avoid=held)
        return train, np.zeros(len(train), np.int8), held.tolist(), dict(source="random token ids")
    texts, info = sources.training_texts(args.max_files)
    probes = heldout_probes(heldout)
    dropped = 0
    for k in KINDS:
        if k != "dialogue":
            texts[k], d = drop_heldout(texts[k], probes)
            dropped += len(d)
    per = -(-args.prompts // len(KINDS))
    rows, kind = [], []
    for i, k in enumerate(KINDS):
        if k == "dialogue":
            got = dialogue_prompts(target, tok, per, p, args.gen_batch, args.seed, end_by)
        else:
            got = windows(tok, texts[k], per, p, rng, flat=k in ("prose", "docs"))
        log(f"prompts: {len(got)} of kind {k} from {len(texts[k])} texts")
        rows += got
        kind += [i] * len(got)
    order = rng.permutation(len(rows))[:args.prompts]
    # every held-out prompt, cut to P tokens: the written ones are 13-20 tokens long, and dropping
    # prompts shorter than P silently left the stories and letters out of the measurement
    held = heldout_ids(tok, heldout, p)
    info.update(dropped_for_heldout=dropped, heldout_kinds=sorted({h.get("kind", "?") for h in heldout}))
    return np.asarray(rows, np.int32)[order], np.asarray(kind, np.int8)[order], held, info


def continue_batch(target, prompts: list[list[int]], new_tokens: int, width: int, sampled: bool,
                   temperature: float, seed: int) -> np.ndarray:
    """int32 [b, width + new_tokens]: each prompt (right-padded with 0 to `width`) and the target's
    `new_tokens` continuation at [width:], classic decoding, sampled (top_p 0.95) or greedy."""
    kw = dict(temperature=temperature, top_p=0.95, seed=seed) if sampled else {}
    r = jaxspec.generate(target, prompts, max_new_tokens=new_tokens, block_size=1, eos_token_ids=[], **kw)
    out = np.zeros((len(prompts), width + new_tokens), np.int32)
    for i, (x, t) in enumerate(zip(prompts, r.tokens)):
        out[i, :len(x)] = x
        out[i, width:] = t[:new_tokens]
    return out


def continue_all(target, prompts: list[list[int]], new_tokens: int, width: int, batch: int) -> np.ndarray:
    """Greedy continuations of every prompt (the held-out ones), `batch` rows per call, the last
    batch padded with copies of its last prompt so that every call runs the one compiled shape."""
    out = []
    for i in range(0, len(prompts), batch):
        part = prompts[i:i + batch]
        rows = continue_batch(target, part + [part[-1]] * (batch - len(part)), new_tokens, width, False, 0.0, 0)
        out.append(rows[:len(part)])
    return np.concatenate(out)


def make_scorer(target, prompt_len: int, k: int):
    """jit (rows int32 [b, P + T]) -> the target's k most likely tokens int32 and log-probabilities
    float16 [b, T, k] at every continuation position (the position before each continuation token).
    The head runs on those T positions only: the prompt's P positions' logits were a third of the
    head's work at P = 64, T = 128 (and half the scoring time on a CPU) for nothing."""
    tcfg = target.config

    @jax.jit  # the target is an argument: closed over, its weights were constants baked into the program
    def score(t, x):
        cache = models.init_cache(tcfg, x.shape[0], x.shape[1], t.dtype, ring=False)
        _, hidden, _ = models.forward(t, x, cache)  # its logits are dead code
        lp = jax.nn.log_softmax(models.head_logits(t, hidden[:, prompt_len - 1:-1]), axis=-1)
        v, i = jax.lax.top_k(lp, k)
        return i.astype(jnp.int32), v.astype(jnp.float16)

    return lambda x: score(target, x)


def teacher_topk(target, rows: np.ndarray, prompt_len: int, k: int, batch: int, scorer=None):
    """`make_scorer`'s (ids [n, T, k], log-probs [n, T, k]) for `rows`, `batch` rows per forward (the
    last padded with copies of its last row: one compiled shape)."""
    score = scorer or make_scorer(target, prompt_len, k)
    ids, lps = [], []
    for i in range(0, len(rows), batch):
        part = rows[i:i + batch]
        pad = batch - len(part)
        x = np.concatenate([part, np.repeat(part[-1:], pad, 0)]) if pad else part
        a, b = score(jnp.asarray(x))
        ids.append(np.asarray(a)[:len(part)])
        lps.append(np.asarray(b)[:len(part)])
    return np.concatenate(ids), np.concatenate(lps)


def batch_order(n_sampled: int, n_greedy: int) -> list[bool]:
    """Which batches are sampled, interleaved so that any prefix keeps the sampled share (a run cut
    short by --minutes still has both kinds, where running all sampled batches first left none greedy)."""
    out, s = [], 0
    total = n_sampled + n_greedy
    for i in range(total):
        take = s < ((i + 1) * n_sampled + total // 2) // total  # the share of the first i + 1, rounded
        out.append(take)
        s += take
    return out


def generate_and_score(target, args, prompts: np.ndarray, end_by: float):
    """Rows of training data, one generation batch at a time, each scored at once: `--minutes` then
    bounds the whole stage (the scoring ran after all the generation, unbounded, and could carry a
    device call past its limit). A batch starts only if the last one's time still fits before
    `end_by` (the slower kind's: a sampled batch costs more than a greedy one). -> (rows [n, P + T],
    top_ids, top_lp, sampled bool [n], index into `prompts` [n], times)."""
    b, p = args.gen_batch, args.prompt_tokens
    n_b = len(prompts) // b
    n_s = int(round(args.sampled_share * n_b))
    score = make_scorer(target, p, args.top_logits)
    rows, ids, lps, sampled, index = [], [], [], [], []
    times = dict(generation_s=0.0, scoring_s=0.0, batches=0)
    last = {True: 0.0, False: 0.0}  # the last batch's seconds, sampled and greedy
    s_i, g_i = 0, n_s  # sampled batches take prompt batches 0.., greedy ones n_s..
    for i, is_s in enumerate(batch_order(n_s, n_b - n_s)):
        if i and time.time() + max(last.values()) > end_by:
            log(f"continuations: time is up after {i} of {n_b} batches ({i * b} rows)")
            break
        j = s_i if is_s else g_i
        s_i, g_i = s_i + is_s, g_i + (not is_s)
        t = time.time()
        part = continue_batch(target, prompts[j * b:(j + 1) * b].tolist(), args.new_tokens, p, is_s,
                              args.temperature, args.seed + j * b)
        t1 = time.time()
        a, c = teacher_topk(target, part, p, args.top_logits, args.score_batch, score)
        t2 = time.time()
        rows.append(part)
        ids.append(a)
        lps.append(c)
        sampled += [is_s] * b
        index.append(np.arange(j * b, (j + 1) * b))
        times["generation_s"] += t1 - t
        times["scoring_s"] += t2 - t1
        times["batches"] += 1
        last[is_s] = t2 - t  # a kind's first batch compiles too: an estimate on the safe side
        if i < 2 or (i + 1) % 8 == 0 or i + 1 == n_b:
            log(f"continuations: batch {i + 1}/{n_b} ({'sampled' if is_s else 'greedy'}, {b} rows): generation "
                f"{t1 - t:.1f}s, scoring {t2 - t1:.1f}s")
    if not rows:
        raise RuntimeError(f"no batch of {b} prompts to continue ({len(prompts)} prompts)")
    times = {k: round(v, 1) for k, v in times.items()}
    return (np.concatenate(rows), np.concatenate(ids), np.concatenate(lps), np.asarray(sampled),
            np.concatenate(index), times)


def write_heldout(path: str, tok, per_kind: int, seed: int, written_from: str | None) -> dict:
    """The held-out prompt file: `per_kind` windows of each held-out kind found under /usr/share, plus
    the older file's written prompts (`written_from`)."""
    rng = np.random.default_rng(seed)
    out = []
    for kind, texts in sources.heldout_texts().items():
        texts = [texts[i] for i in rng.permutation(len(texts))]
        got = 0
        for name, text in texts:
            if got >= per_kind:
                break
            start = int(rng.integers(0, max(1, len(text) - 1200)))
            cut = text.find("\n", start)
            snippet = text[cut + 1 if cut >= 0 else start:][:600]
            if kind == "legal":
                snippet = " ".join(snippet.split())
            if len(tok.encode(snippet)) >= 80:
                out.append(dict(kind=kind, source=name, text=snippet))
                got += 1
    if written_from:
        with open(written_from) as f:
            old = json.load(f)["prompts"]
        out += [dict(p, kind="written") for p in old if p.get("source", "").startswith("written")]
    with open(path, "w") as f:
        json.dump(dict(prompts=out, note="never trained on: sources jaxspec.train.onpolicy_sources.training_texts "
                                          "does not read"), f, indent=1, ensure_ascii=False)
    return {k: sum(p["kind"] == k for p in out) for k in sorted({p["kind"] for p in out})}


def build_parser():
    p = inputs.Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="a model name (gemma-3-270m), a .gguf or a checkpoint dir")
    p.add_argument("--target-name", default=None)
    p.add_argument("--work", default=None, help="the data directory to write (yours only)")
    p.add_argument("--write-heldout", default=None, help="write the held-out prompt file and stop")
    p.add_argument("--heldout", default=None, help=f"held-out prompts JSON (default drafters/<name>/{HELDOUT_FILE})")
    p.add_argument("--random-prompts", action="store_true")
    p.add_argument("--prompts", type=int, default=None, help="training rows (GPU 32768, CPU 64)")
    p.add_argument("--heldout-prompts", type=int, default=8, help="random held-out prompts (--random-prompts)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--sampled-share", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-logits", type=int, default=16, help="target log-probabilities kept per position")
    p.add_argument("--gen-batch", type=int, default=None, help="rows per generation call (GPU 512, CPU 16)")
    p.add_argument("--score-batch", type=int, default=None, help="rows per scoring forward (GPU 32, CPU 4)")
    p.add_argument("--minutes", type=float, default=9.0)
    p.add_argument("--max-files", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    return inputs.cli(PROG, _run, argv)


def _run(argv) -> int:
    start = reset_clock()
    args = build_parser().parse_args(argv)
    from jaxspec.train.assistant import target_name_of
    name = target_name_of(args.target, args.target_name)
    if args.write_heldout:
        tok = inputs.tokenizer_of(args.target)
        counts = write_heldout(args.write_heldout, tok, 8, args.seed,
                               os.path.join(DRAFTERS, name, "heldout_prompts.json"))
        log(f"held-out prompts written to {args.write_heldout}: {counts}")
        return 0
    on_gpu = jax.default_backend() == "gpu"
    for k, v in dict(prompts=32768 if on_gpu else 64, gen_batch=512 if on_gpu else 16,
                     score_batch=32 if on_gpu else 4).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.work:
        raise inputs.UsageError("--work is required (the data directory to write)")
    for flag in ("prompts", "gen_batch", "score_batch", "prompt_tokens", "new_tokens", "top_logits"):
        if getattr(args, flag) < 1:
            raise inputs.UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0.0 <= args.sampled_share <= 1.0 or not args.temperature > 0 or not args.minutes > 0:
        raise inputs.UsageError("--sampled-share must be in [0, 1], --temperature and --minutes > 0")
    if args.top_logits > 256:
        raise inputs.UsageError(f"--top-logits {args.top_logits} > 256: the data would be large for little")
    heldout, _ = ([], None) if args.random_prompts else inputs.load_heldout(
        args.heldout, os.path.join(DRAFTERS, name, HELDOUT_FILE))
    if not args.random_prompts and not heldout:
        raise inputs.UsageError(f"no held-out prompts: pass --heldout or write drafters/{name}/{HELDOUT_FILE}")
    inputs.prepare_work(args.work, False)
    end = start + 60.0 * args.minutes
    target = models.load_target(args.target, dtype=jnp.bfloat16 if on_gpu else jnp.float32,
                                matmul=DispatchConfig.from_env(backend="auto"))
    tok = None if args.random_prompts else inputs.tokenizer_of(args.target)
    t = time.time()
    prompts, kind, held, info = build_prompts(args, target, tok, heldout, start + 0.3 * (end - start))
    log(f"prompts: {len(prompts)} training, {len(held)} held-out ({time.time() - t:.1f}s)")
    if len(prompts) < args.gen_batch:
        raise RuntimeError(f"{len(prompts)} prompts are fewer than one --gen-batch ({args.gen_batch})")
    t = time.time()
    # the held-out prompts first, every one of them (they are the evaluation: a time-cut left some out)
    held_rows = continue_all(target, held, args.new_tokens, args.prompt_tokens, min(len(held), args.gen_batch))
    held_len = np.asarray([len(h) for h in held], np.int32)
    log(f"held-out: {len(held_rows)} prompts ({int((held_len < args.prompt_tokens).sum())} shorter than "
        f"{args.prompt_tokens} tokens, right-padded) continued in {time.time() - t:.1f}s")
    # the stage's last seconds are kept for writing the data
    rows, top_ids, top_lp, sampled, index, times = generate_and_score(
        target, args, prompts, end - min(30.0, 0.05 * (end - start)))
    kind = kind[index]
    log(f"continuations: {len(rows)} rows ({int(sampled.sum())} sampled), teacher top-{args.top_logits}: "
        f"generation {times['generation_s']}s, scoring {times['scoring_s']}s")
    counts = np.bincount(rows[:, args.prompt_tokens:].reshape(-1), minlength=target.config.vocab_size)
    np.savez(os.path.join(args.work, "data.npz"), rows=rows, top_ids=top_ids, top_lp=top_lp, kind=kind,
             sampled=sampled, heldout_rows=held_rows, heldout_lengths=held_len, counts=counts)
    info.update(target=name, prompts=len(rows), sampled=int(sampled.sum()), temperature=args.temperature,
                prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, top_logits=args.top_logits,
                kinds=list(KINDS), heldout=len(held_rows), gen_batch=args.gen_batch, score_batch=args.score_batch,
                **times, seconds=round(time.time() - start, 1), device=str(jax.devices()[0]))
    with open(os.path.join(args.work, "info.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)
    log(f"data written to {args.work} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
