"""speculative_bench: classic vs MTP speculative decoding, verify cost, padded-verify A/B.

    python benchmarks/speculative_bench.py --target 12b --assistant 12b --k-values 2,4 \
        --verify-pad off,on --qmm-tile-m 16,64 --multirow on,off --out DIR
    python benchmarks/speculative_bench.py --target default --runs loop --k-values 4 --max-tokens 64 \
        --each-prompt --out DIR          (the shipped pair on its held-out prompts: README's row)
    python benchmarks/speculative_bench.py --target gemma-3-270m --runs loop --k-values 2,3,4 --each-prompt \
        --backend xla --out DIR          (Gemma 3 270M + its shipped drafter on the drafter's held-out prompts)

Runs (--runs, comma separated):
  forward  per-forward time of the target at [B, T] for T = 1 and every K (and the padded width),
           in classic forwards, multirow on/off; one assistant draft step; bitwise verify == decode.
  loop     jaxspec.generate classic vs speculative for every (multirow, K, B, verify_pad, tile_m):
           decode tokens/s (prefill excluded, first token counted), speedup, acceptance, mean
           accepted length, tokens per round, round cost in classic forwards, draft and verify ms
           per round (timed as separate calls at the round's shapes), greedy parity, per-position
           acceptance (how often draft 1, 2, 3 is kept: GenerationStats.position_accepted). With
           --each-prompt every prompt runs alone (B = 1), the decode times and counts are summed, and
           each prompt's own row is kept too: acceptance, tokens per round, acceptance length
           (1 + accepted / rounds, vLLM's and SGLang's), per-position acceptance, greedy == classic.
  scaling  classic aggregate tokens/s at each --scaling-batch.
Every configuration is its own compiled function, warmed up before timing; medians over repeats.
The models' DispatchConfig is built once, `DispatchConfig.from_env(...)` with --backend applied, and
passed to the loaders; --multirow and --qmm-tile-m are explicit `config.replace(...)` variants of it.
Writes DIR/speculative.json, DIR/speculative.md and DIR/speculative.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxspec import models  # noqa: E402
from harness import (Q4, devices_error, environment, hbm_bandwidth, median_time, random_pair,  # noqa: E402
                     split_pair)
from jaxspec.kernels import DispatchConfig, QuantizedWeight  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec import default_pair as dp  # noqa: E402
from jaxspec.engine import verify  # noqa: E402
from jaxspec.engine.generate import MAX_VERIFY_WIDTH, PROMPT_BUCKET  # noqa: E402
from jaxspec.engine.loop_config import LoopConfig, round_up  # noqa: E402
from jaxspec.progress import bar  # noqa: E402

# The seed system's measured acceptance on its real Gemma pair at K = 4, for predicted speedups with
# random weights (only for rounds that ran K = 4: at K = 2 a round yields at most 2 tokens).
SEED_K = 4
SEED_TOKENS_PER_ROUND = {"mean accepted 1.07 (K=4)": 2.07, "2.90 tokens/verify": 2.90}


def _csv(s, conv=str):
    return [conv(v) for v in s.split(",") if v != ""]


def _onoff(v):
    if v in ("on", "1", "true"):
        return True
    if v in ("off", "0", "false"):
        return False
    raise argparse.ArgumentTypeError(f"expected on/off, got {v!r}")


def load_pair(args, dtype, matmul: DispatchConfig):
    """(target, assistant or None, description) for --target / --assistant, both on `matmul`."""
    q = None if args.float or getattr(args, "pair_name", None) else Q4  # a named pair loads exactly, as the CLI
    if os.path.isdir(args.target) or os.path.isfile(args.target):  # a checkpoint directory or a .gguf file
        target = models.load_target(args.target, dtype=dtype, quantize=q, matmul=matmul)
        assistant = (models.load_assistant(args.assistant, dtype=dtype, quantize=q, matmul=matmul, target=target)
                     if args.assistant and os.path.isdir(args.assistant) else None)
        if getattr(args, "pair_name", None):
            return target, assistant, f"pair {args.pair_name}: {args.target} + drafter {args.assistant}"
        return target, assistant, f"checkpoint {args.target}"
    target, assistant = random_pair(args.target, args.assistant, layers=args.layers, matmul=matmul,
                                    seed=args.seed, dtype=dtype, quantize=q)
    what = f"preset {args.target}" + (f" (first {args.layers} of its layers)" if args.layers else "")
    return target, assistant, what + ", random 4-bit weights"


def weight_bytes_per_token(target) -> int:
    """Bytes of all target weights a decode step reads (every linear, norms, the tied head once)."""
    total = 0
    for name, w in target.params.items():
        if name.startswith("embed_tokens_per_layer"):
            continue  # per-layer embedding rows are gathered, not streamed
        if isinstance(w, QuantizedWeight):
            total += w.nbytes
        else:
            total += int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize
    return total


def resolve_default_pair(args):
    """`--target default`: the shipped pair, its tokenizer, and its held-out prompts unless others are given."""
    if args.target != "default":
        return
    path = dp.default_pair_path()
    if not dp.default_pair_available(path):
        raise SystemExit(f"--target default: the default pair is not installed at {path} "
                         f"(missing {dp.missing_files(path)})")
    args.target = os.path.join(path, "target")
    if args.assistant in (None, "default"):
        args.assistant = None if args.no_assistant else os.path.join(path, "assistant")
    args.tokenizer = args.tokenizer or os.path.join(path, "tokenizer.json")
    if not (args.prompts or args.prompts_file or args.prompt_ids or args.prompt):
        args.default_prompts = [p["ids"] for p in dp.heldout_prompts(path)]


def resolve_named_pair(args):
    """`--target gemma-3-270m` (a real pair, jaxspec.pairs): the GGUF target, its shipped drafter (or
    --assistant DIR), its tokenizer, and the drafter's held-out prompts unless others are given."""
    from jaxspec import pairs

    if args.target not in pairs.REAL or os.path.exists(args.target):
        return
    name = args.target
    drafter = None if args.assistant in (None, name) else args.assistant
    try:
        if args.no_assistant:
            from jaxspec.models import gguf
            pair = pairs.Pair(name, gguf.by_name(name), None)
        else:
            pair = pairs.resolve(name, drafter)
    except ValueError as e:
        raise SystemExit(f"--target {name}: {e}") from None
    args.pair_name, args.target, args.assistant = name, pair.target, pair.assistant
    args.tokenizer = args.tokenizer or pair.target  # the GGUF carries its tokenizer
    heldout = os.path.join(pairs.drafter_dir(name) if drafter is None else drafter, "heldout_prompts.json")
    if not (args.prompts or args.prompts_file or args.prompt_ids or args.prompt) and os.path.isfile(heldout):
        args.prompts = heldout


def text_prompts(args):
    """--prompts FILE: JSON, {"prompts": [...]} or a list, each a string, {"text": ...} (tokenized with
    the target's tokenizer, BOS first), a list of ids or {"ids": [...]}; a "kind" (prose, code) is kept
    for the report.
    -> (ids per prompt, kind per prompt)."""
    with open(args.prompts, encoding="utf-8") as f:
        data = json.load(f)
    items = data["prompts"] if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise SystemExit(f"--prompts {args.prompts}: expected a non-empty list of prompts (or {{\"prompts\": [...]}})")
    tok = None
    ids, kinds = [], []
    for i, p in enumerate(items):
        p = {"text": p} if isinstance(p, str) else {"ids": p} if isinstance(p, list) else p
        if not isinstance(p, dict) or not ("ids" in p or "text" in p):
            raise SystemExit(f"--prompts {args.prompts}: prompt {i} has neither \"text\" nor \"ids\"")
        if "ids" in p:
            ids.append([int(t) for t in p["ids"]])
        else:
            if tok is None:
                from jaxspec.text import load_tokenizer
                src = args.tokenizer or args.target
                try:
                    tok = load_tokenizer(os.path.dirname(src) if src.endswith(".json") else src,
                                         src if src.endswith(".json") else None)
                except ValueError as e:
                    raise SystemExit(f"--prompts {args.prompts}: text prompts need a tokenizer: {e}") from None
            ids.append(tok.encode(p["text"]))
        kinds.append(p.get("kind", ""))
    return ids, kinds


def tokenize_prompt(args):
    """`--prompt TEXT` -> ids, with --tokenizer or the tokenizer.json of the target checkpoint."""
    from tokenizers import Tokenizer
    candidates = [args.tokenizer] if args.tokenizer else (
        [os.path.join(args.target, "tokenizer.json"), os.path.join(args.target, "..", "tokenizer.json")]
        if os.path.isdir(args.target) else [])
    for f in candidates:
        if f and os.path.isfile(f):
            return Tokenizer.from_file(f).encode(args.prompt).ids
    raise SystemExit(f"--prompt needs a tokenizer: pass --tokenizer FILE (none found for --target "
                     f"{args.target!r}; presets have none, use --prompt-ids or --prompt-len there)")


def prompt_rows(args, vocab, batch):
    """The prompts given (file, ids, text, the default pair's held-out ones), else `batch` random ones."""
    rng = np.random.default_rng(args.seed)
    if args.prompts:
        return args.text_prompt_ids
    if args.prompts_file:
        return [json.loads(l) for l in open(args.prompts_file) if l.strip()]
    if args.prompt_ids:
        return [json.loads(args.prompt_ids)]
    if args.prompt:
        return [args.prompt_tokens]
    if getattr(args, "default_prompts", None):
        return args.default_prompts
    return [rng.integers(1, vocab, size=args.prompt_len).tolist() for _ in range(batch)]


def prompts(args, vocab, batch):
    """One batch of `batch` rows, cycling through the prompts."""
    rows = prompt_rows(args, vocab, batch)
    return [rows[i % len(rows)] for i in range(batch)]


def prompt_sets(args, vocab, batch):
    """The batches the loop run decodes: every prompt alone with --each-prompt, else one batch."""
    if args.each_prompt:
        return [[r] for r in prompt_rows(args, vocab, batch)]
    return [prompts(args, vocab, batch)]


# ----------------------------------------------------------------------------------------------
def forward_loop(target, batch, width, k_real, steps=8, context=64):
    """(jitted fn, its args): `steps` dependent target forwards over [batch, width] tokens (k_real
    real, the rest padding) at a fixed position, in one fori_loop. The model is an argument of the
    jit, never a closure: captured weights become HLO constants (6.7 GB at 12B) and compiles that
    take minutes. `context`: positions already in the cache (its keys are zeros: attention's cost
    does not depend on their values); the cache holds them plus 192, as a run at that length would."""
    cap = max(256, -(-(context + 192) // 256) * 256)

    @jax.jit
    def run(target, tokens, cache):
        def body(_, carry):
            toks, c = carry
            if width > k_real:
                logits, hidden, c2 = verify.verify_forward(target, toks[:, :k_real], c, width)
            else:
                logits, hidden, c2 = models.forward(target, toks, c)
            nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            toks = toks.at[:, 0].set(nxt)
            return toks, c2.replace(lengths=c.lengths)
        return jax.lax.fori_loop(0, steps, body, (tokens, cache))[0]

    cache = models.init_cache(target.config, batch, cap, target.dtype)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    tokens = jnp.ones((batch, width), jnp.int32)
    return run, (target, tokens, cache)


def forward_time(target, batch, width, k_real, steps=8):
    """Seconds per target forward over [batch, width] tokens (see forward_loop)."""
    run, args = forward_loop(target, batch, width, k_real, steps)
    return median_time(run, *args, warmup=1, repeats=5) / steps


def draft_loop(assistant, target, batch, steps=8):
    """(jitted fn, its args): `steps` chained assistant draft steps over a cache of 64 committed
    keys, unrolled as the loop's draft scan runs them (no device loop between steps)."""
    cache = models.init_cache(target.config, batch, 256, target.dtype)
    cache = cache.replace(lengths=jnp.full((batch,), 64, jnp.int32))
    h = jnp.ones((batch, target.config.hidden_size), target.dtype)

    @jax.jit
    def run(assistant, target, cache, tok, h):
        for _ in range(steps):
            logits, h = models.draft_step(assistant, target, cache, tok, h, cache.lengths)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return tok, h

    return run, (assistant, target, cache, jnp.ones((batch,), jnp.int32), h)


def draft_time(assistant, target, batch, steps=8):
    """Seconds per assistant draft step at `batch` rows (see draft_loop)."""
    run, args = draft_loop(assistant, target, batch, steps)
    return median_time(run, *args, warmup=1, repeats=5) / steps


def verify_bitwise(target, batch, k):
    """Are the logits of one [B, K] forward bitwise those of K [B, 1] forwards (row invariance)?"""
    cache = models.init_cache(target.config, batch, 128, target.dtype)
    rng = np.random.default_rng(0)
    prefix = jnp.asarray(rng.integers(1, target.config.vocab_size, (batch, 16)), jnp.int32)
    block = jnp.asarray(rng.integers(1, target.config.vocab_size, (batch, k)), jnp.int32)
    fwd = jax.jit(models.forward)
    _, _, c = fwd(target, prefix, cache)
    wide, _, _ = fwd(target, block, c)
    steps = []
    for i in range(k):
        lg, _, c = fwd(target, block[:, i:i + 1], c)
        steps.append(lg)
    narrow = jnp.concatenate(steps, axis=1)
    return bool(jnp.array_equal(wide, narrow)), float(jnp.max(jnp.abs(wide - narrow)))


def run_forward(args, target, assistant, out, deadline):
    base = target.matmul
    t1 = None
    for mr in args.multirow:
        tgt = target.replace(matmul=base.replace(multirow=mr))
        for b in args.batch:
            f1 = forward_time(tgt, b, 1, 1)
            if mr and b == args.batch[0]:
                t1 = f1
            out.append(dict(run="forward", multirow=mr, batch=b, width=1, k=1, ms=f1 * 1e3, cost=1.0))
            print(f"forward B={b} multirow={mr} T=1: {f1 * 1e3:.2f} ms", flush=True)
            for k in args.k_values:
                if time.time() > deadline:
                    return t1
                fk = forward_time(tgt, b, k, k)
                out.append(dict(run="forward", multirow=mr, batch=b, width=k, k=k, ms=fk * 1e3, cost=fk / f1))
                print(f"  verify K={k}: {fk * 1e3:.2f} ms = {fk / f1:.2f} forwards", flush=True)
                if mr and "on" in args.verify_pad_raw and k in args.pad_k_values:
                    for tm in args.qmm_tile_m:
                        w = LoopConfig.derive(k, b, 0, 1, True, base.replace(qmm_tile_m=tm)).verify_width
                        tp = forward_time(target.replace(matmul=base.replace(qmm_tile_m=tm)), b, w, k)
                        out.append(dict(run="forward", multirow=mr, batch=b, width=w, k=k, tile_m=tm,
                                        ms=tp * 1e3, cost=tp / f1, padded=True))
                        print(f"  padded K={k} -> {w} tile_m={tm}: {tp * 1e3:.2f} ms = {tp / f1:.2f}", flush=True)
    if assistant is not None:
        for b in args.batch:
            d = draft_time(assistant, target, b)
            out.append(dict(run="draft", batch=b, ms=d * 1e3))
            print(f"draft step B={b}: {d * 1e3:.2f} ms", flush=True)
    for k in args.k_values:
        eq, diff = verify_bitwise(target, args.batch[0], k)
        out.append(dict(run="bitwise", batch=args.batch[0], k=k, equal=eq, max_abs_diff=diff))
        print(f"verify K={k} bitwise == {k} decode steps: {eq} (max |diff| {diff:.3g})", flush=True)
    return t1


def _progress(items, what, quiet=False):
    """A progress bar on stderr over a sweep of several items, e.g. the 20 prompts of --each-prompt,
    when stderr is a terminal and not --quiet (jaxspec.progress); the result lines stay on stdout."""
    return bar(items, desc=what, enabled=False if quiet or len(items) < 2 else None)


def gen_stats(target, assistant, sets, k, args, pad):
    """Decode every batch of `sets` (median decode time over --repeats after --warmup each) and sum
    them: (the tokens of each batch, the summed statistics). Rates are over the sums (acceptance =
    accepted / drafted; per-round means weighted by each batch's active row-rounds)."""
    tokens, stats, decode_s = [], [], 0.0
    # --each-prompt: one cache size for every prompt and K (the widest prompt's bucket, the widest verify
    # run), so the decode loop compiles once per K, not once per prompt-length bucket
    cache = None
    if len(sets) > 1:
        longest = max(len(r) for rows in sets for r in rows)
        widest = MAX_VERIFY_WIDTH if any(args.verify_pad) else max(args.k_values)
        cache = LoopConfig.derive(widest, 1, round_up(longest, PROMPT_BUCKET), args.max_tokens, False, None).capacity
    for rows in _progress(sets, f"{'classic' if k == 1 else f'K={k}'} prompts", args.quiet):
        res, times = None, []
        for _ in range(args.warmup + args.repeats):
            res = jaxspec.generate(target, rows, assistant=assistant if k > 1 else None, block_size=k,
                                   drafter=args.draft if k > 1 and args.draft == "ngram" else None,
                                   max_new_tokens=args.max_tokens, verify_pad=pad, eos_token_ids=[],
                                   exactness_probe=args.exactness_probe, cache_size=cache)
            times.append(res.stats.decode_s)
        tokens.append(res.tokens)
        stats.append(res.stats)
        decode_s += statistics.median(times[args.warmup:])
    total = lambda f: sum(getattr(st, f) for st in stats)  # noqa: E731
    row_rounds = total("row_rounds")
    per_round = lambda f: (sum(getattr(st, f) * st.row_rounds for st in stats) / row_rounds  # noqa: E731
                           if row_rounds else getattr(stats[0], f))
    hist = [0] * max(len(st.accepted_hist) for st in stats)
    for st in stats:
        for a, c in enumerate(st.accepted_hist):
            hist[a] += c
    drafted = total("drafted")
    # per-position acceptance over the sums: the loop's own counts (GenerationStats.position_accepted)
    pos = [sum(c) for c in zip(*(st.position_accepted for st in stats))] if stats[0].position_accepted else []
    return tokens, dict(decode_s=decode_s, tokens_per_s=total("new_tokens") / decode_s, rounds=total("rounds"),
                        acceptance_rate=total("accepted") / drafted if drafted else 0.0,
                        mean_accepted_len=per_round("mean_accepted_len"),
                        tokens_per_round=per_round("tokens_per_round"),
                        fallback=next((st.fallback for st in stats if st.fallback), None),
                        new_tokens=total("new_tokens"), hist=hist, verify_width=stats[-1].verify_width,
                        k_run=min(st.block_size for st in stats), prompts=len(sets),
                        acceptance_length=1 + total("accepted") / row_rounds if row_rounds else 1.0,
                        position_accepted=pos, position_acceptance=[c / row_rounds for c in pos] if row_rounds else [],
                        per_prompt=[_prompt_row(st) for st in stats] if len(sets) > 1 else None)


def _prompt_row(st) -> dict:
    """One --each-prompt call's own counts: acceptance, tokens per round, acceptance length
    (1 + accepted / rounds, as vLLM and SGLang report it), per-position acceptance."""
    r = st.row_rounds
    return dict(rounds=r, new_tokens=st.new_tokens, accepted=st.accepted, drafted=st.drafted,
                acceptance_rate=st.acceptance_rate, tokens_per_round=st.tokens_per_round,
                acceptance_length=1 + st.accepted / r if r else 1.0, position_accepted=st.position_accepted,
                position_acceptance=st.position_acceptance, decode_s=st.decode_s, k_run=st.block_size)


def round_phases(target, batch, spec, draft_step_ms, round_ms):
    """A round's draft and verify milliseconds, timed as separate jitted calls at the round's shapes
    (the loop is one jitted function: its phases cannot be timed inside it): K-1 assistant steps, one
    verify forward of the width the loop ran; the rest is acceptance and bookkeeping. Empty when
    the loop fell back to classic decoding."""
    k = spec["k_run"]
    if k < 2:
        return {}
    verify_ms = forward_time(target, batch, spec["verify_width"], k) * 1e3
    draft_ms = (k - 1) * draft_step_ms
    return dict(draft_ms=draft_ms, verify_ms=verify_ms, other_ms=round_ms - draft_ms - verify_ms)


def run_loop(args, target, assistant, out, deadline):
    base = target.matmul
    for mr in args.multirow:
        for b in args.batch:
            sets = prompt_sets(args, target.config.vocab_size, b)
            tgt = target.replace(matmul=base.replace(multirow=mr))
            ctoks, classic = gen_stats(tgt, None, sets, 1, args, False)
            per_fwd = classic["decode_s"] / max(classic["rounds"], 1)
            out.append(dict(run="loop", mode="classic", multirow=mr, batch=b, **classic))
            print(f"classic B={b} multirow={mr}: {classic['tokens_per_s']:.1f} tok/s "
                  f"({per_fwd * 1e3:.2f} ms/step)", flush=True)
            if assistant is None and args.draft != "ngram":
                continue
            # one assistant step at this batch (prompt lookup's drafting is part of the round's "other")
            draft_step_ms = draft_time(assistant, tgt, b) * 1e3 if assistant is not None else 0.0
            for k in args.k_values:
                for pad in args.verify_pad:
                    for tm in (args.qmm_tile_m if pad else [None]):
                        if time.time() > deadline:
                            print("time budget reached: skipping the rest of the loop runs", flush=True)
                            return
                        t = tgt.replace(matmul=tgt.matmul.replace(qmm_tile_m=tm)) if tm else tgt
                        stoks, spec = gen_stats(t, assistant, sets, k, args, pad)
                        round_s = spec["decode_s"] / max(spec["rounds"], 1)
                        same = sum(s == c for s, c in zip(stoks, ctoks))
                        for i, pr in enumerate(spec["per_prompt"] or []):  # parity and kind per prompt
                            pr.update(prompt=i, greedy_equal=stoks[i] == ctoks[i],
                                      kind=(getattr(args, "prompt_kinds", None) or [""] * len(sets))[i])
                        row = dict(run="loop", mode="speculative", multirow=mr, batch=b, k=k, verify_pad=pad,
                                   tile_m=tm, **spec, speedup=spec["tokens_per_s"] / classic["tokens_per_s"],
                                   round_ms=round_s * 1e3, round_cost=round_s / per_fwd,
                                   greedy_equal=same == len(sets), greedy_equal_prompts=f"{same}/{len(sets)}")
                        row.update(round_phases(t, b, spec, draft_step_ms, row["round_ms"]))
                        if spec["k_run"] == SEED_K:
                            for name, tpr in SEED_TOKENS_PER_ROUND.items():
                                row[f"predicted[{name}]"] = tpr / row["round_cost"]
                        out.append(row)
                        print(f"  K={k} pad={pad} tile_m={tm}: {spec['tokens_per_s']:.1f} tok/s "
                              f"x{row['speedup']:.2f}, accept {spec['acceptance_rate']:.2f}, "
                              f"{spec['tokens_per_round']:.2f} tok/round, per position "
                              f"{'/'.join(f'{a:.2f}' for a in spec['position_acceptance'])}, "
                              f"round {row['round_cost']:.2f} fwd, parity {row['greedy_equal']}"
                              + (f", ran K={spec['k_run']}" if spec["k_run"] != k else "")
                              + (f", FALLBACK {spec['fallback']}" if spec["fallback"] else ""), flush=True)


def run_scaling(args, target, out, deadline):
    for b in args.scaling_batch:
        if time.time() > deadline:
            return
        rows = prompts(args, target.config.vocab_size, b)
        _, classic = gen_stats(target, None, [rows], 1, args, False)
        out.append(dict(run="scaling", batch=b, **classic))
        print(f"scaling classic B={b}: {classic['tokens_per_s']:.1f} tok/s aggregate", flush=True)


def _ms(v):
    return "" if v is None else f"{v:.2f}"


def write_report(path, meta, rows):
    json.dump(dict(meta=meta, rows=rows), open(os.path.join(path, "speculative.json"), "w"), indent=1)
    lines = [f"# speculative_bench — {meta['what']}", "",
             f"{meta['env']['device']}, JAX {meta['env']['jax']}, commit {meta['env']['commit']}, "
             f"{meta['env']['date']}", "",
             "Command: `" + "".join(f"{k}={v} " for k, v in meta.get("jaxspec_env", {}).items())
             + f"{meta['command']}`", ""]
    if meta.get("matmul"):
        lines += ["Models' DispatchConfig: " + ", ".join(f"{k}={v}" for k, v in meta["matmul"].items()), ""]
    if meta.get("floor_ms"):
        lines += [f"Weight bytes per token: {meta['weight_bytes'] / 1e9:.3f} GB; floor at "
                  f"{meta['hbm_tbps']:.2f} TB/s: {meta['floor_ms']:.3f} ms"
                  + (f"; decode forward at {meta['decode_pct_of_floor']:.1f}% of it" if meta.get("decode_pct_of_floor") else ""), ""]
    fw = [r for r in rows if r["run"] in ("forward", "draft", "bitwise")]
    if fw:
        lines += ["## Forward cost", "", "| what | multirow | B | width (K) | tile_m | ms | cost (classic fwd) |",
                  "|---|---|---|---|---|---|---|"]
        for r in fw:
            if r["run"] == "forward":
                lines.append(f"| {'padded verify' if r.get('padded') else ('decode' if r['width'] == 1 else 'verify')} "
                             f"| {r['multirow']} | {r['batch']} | {r['width']} ({r['k']}) | {r.get('tile_m', '')} "
                             f"| {r['ms']:.3f} | {r['cost']:.2f} |")
            elif r["run"] == "draft":
                lines.append(f"| assistant draft step | | {r['batch']} | | | {r['ms']:.3f} | |")
            else:
                lines.append(f"| verify K={r['k']} bitwise == K decode steps | | {r['batch']} | | | "
                             f"{'yes' if r['equal'] else 'NO'} (max diff {r['max_abs_diff']:.3g}) | |")
        lines.append("")
    lp = [r for r in rows if r["run"] == "loop"]
    if lp:
        lines += ["## Decode loop", "",
                  "| mode | multirow | B | K | pad | tile_m | tok/s | speedup | accept | mean acc. len | tok/round "
                  "| round ms | draft ms | verify ms | round cost | predicted (seed accept.) | greedy == classic |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in lp:
            pred = ", ".join(f"{v:.2f}x" for k, v in r.items() if k.startswith("predicted"))
            k_col = f"{r.get('k', 1)}" + (f" (ran {r['k_run']})" if r.get("k_run", r.get("k", 1)) != r.get("k", 1) else "")
            lines.append(f"| {r['mode']} | {r['multirow']} | {r['batch']} | {k_col} | {r.get('verify_pad', '')} "
                         f"| {r.get('tile_m') or ''} | {r['tokens_per_s']:.1f} | {r.get('speedup', 1.0):.2f} "
                         f"| {r['acceptance_rate']:.2f} | {r['mean_accepted_len']:.2f} | {r['tokens_per_round']:.2f} "
                         f"| {r.get('round_ms', 0):.2f} | {_ms(r.get('draft_ms'))} | {_ms(r.get('verify_ms'))} "
                         f"| {r.get('round_cost', 1.0):.2f} | {pred} "
                         f"| {r.get('greedy_equal_prompts') if r.get('prompts', 1) > 1 else r.get('greedy_equal', '')}"
                         f"{' FALLBACK: ' + r['fallback'] if r.get('fallback') else ''} |")
        lines.append("")
        lines += _position_tables(lp)
    sc = [r for r in rows if r["run"] == "scaling"]
    if sc:
        b1 = sc[0]["tokens_per_s"]
        lines += ["## Batched classic decode", "", "| B | aggregate tok/s | x B=1 |", "|---|---|---|"]
        lines += [f"| {r['batch']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / b1:.2f} |" for r in sc]
        lines.append("")
    open(os.path.join(path, "speculative.md"), "w").write("\n".join(lines))
    try:
        fig = plot_figure(rows)
        if fig is not None:
            fig.savefig(os.path.join(path, "speculative.png"), dpi=110)
    except Exception as e:  # the plot is a convenience; the tables are the result
        print(f"plot skipped: {e}")


def _position_tables(loop_rows) -> list[str]:
    """Markdown: per-position acceptance (how often draft 1, 2, ... is kept) of every speculative loop
    row, then with --each-prompt one table per K of the prompts' own rows."""
    spec = [r for r in loop_rows if r["mode"] == "speculative" and r.get("position_acceptance")]
    if not spec:
        return []
    width = max(len(r["position_acceptance"]) for r in spec)
    pos_head = " | ".join(f"draft {i + 1} kept" for i in range(width))
    lines = ["## Per-position acceptance", "",
             "Acceptance length = 1 + accepted / rounds; draft i kept = rounds that kept draft i / rounds.", "",
             f"| K | B | prompts | tok/round | acceptance length | acceptance | {pos_head} | greedy == classic |",
             "|---|---|---|---|---|---|" + "---|" * width + "---|"]
    cell = lambda xs: " | ".join(f"{x:.3f}" for x in xs) + " |" * (width - len(xs))  # noqa: E731
    for r in spec:
        lines.append(f"| {r['k']} | {r['batch']} | {r.get('prompts', 1)} | {r['tokens_per_round']:.2f} "
                     f"| {r['acceptance_length']:.2f} | {r['acceptance_rate']:.3f} | {cell(r['position_acceptance'])} "
                     f"| {r.get('greedy_equal_prompts') if r.get('prompts', 1) > 1 else r.get('greedy_equal')} |")
    lines.append("")
    for r in spec:
        if not r.get("per_prompt"):
            continue
        lines += [f"### K = {r['k']}, each prompt alone", "",
                  f"| prompt | kind | rounds | tok/round | acceptance length | acceptance | {pos_head} | greedy == classic |",
                  "|---|---|---|---|---|---|" + "---|" * width + "---|"]
        for p in r["per_prompt"]:
            lines.append(f"| {p['prompt']} | {p.get('kind', '')} | {p['rounds']} | {p['tokens_per_round']:.2f} "
                         f"| {p['acceptance_length']:.2f} | {p['acceptance_rate']:.3f} | {cell(p['position_acceptance'])} "
                         f"| {'yes' if p.get('greedy_equal') else 'NO'} |")
        lines.append("")
    return lines


def plot_figure(rows):
    """The report's figure: one panel per kind of run that has rows (verify forward cost, the decode
    loop's speedup by K, batched classic decode), so no panel is left empty (a `--runs loop` run,
    e.g. `--target default --each-prompt`, used to get a blank second panel). None without rows
    to plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = rows[0].get("batch", 1) if rows else 1
    fw = {mr: sorted((r["width"], r["cost"]) for r in rows if r["run"] == "forward" and r["multirow"] == mr
                     and not r.get("padded") and r["batch"] == batch) for mr in (True, False)}
    lp = [r for r in rows if r["run"] == "loop" and r["mode"] == "speculative"]
    sc = [r for r in rows if r["run"] == "scaling"]
    panels = [name for name, has in (("forward", any(fw.values())), ("loop", lp), ("scaling", sc)) if has]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, name in zip(axes[0], panels):
        if name == "forward":
            for mr, pts in fw.items():
                if pts:
                    ax.plot(*zip(*pts), "o-", label=f"multirow {'on' if mr else 'off'}")
            ax.plot([1, 8], [1, 8], ":", color="gray", label="K forwards")
            ax.set_xlabel("verify width K"), ax.set_ylabel("cost in classic forwards"), ax.legend()
            ax.set_title("verify forward cost")
        elif name == "loop":
            series = sorted({(r["multirow"], r["batch"]) for r in lp})
            for mr, b in series:
                pts = sorted((r["k"], r["speedup"]) for r in lp if (r["multirow"], r["batch"]) == (mr, b))
                ax.plot(*zip(*pts), "o-", label=f"B={b}, multirow {'on' if mr else 'off'}")
            ax.axhline(1.0, ls=":", color="gray", label="classic")
            ax.set_xlabel("K (drafts + 1)"), ax.set_ylabel("decode speedup over classic"), ax.legend()
            ax.set_title("speculative decode loop")
        else:
            ax.plot([r["batch"] for r in sc], [r["tokens_per_s"] for r in sc], "o-")
            ax.set_xscale("log", base=2), ax.set_xlabel("batch"), ax.set_ylabel("aggregate tok/s")
            ax.set_title("classic batched decode")
    fig.tight_layout()
    return fig


def build_parser():
    ap = argparse.ArgumentParser(prog="speculative_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="12b",
                    help="checkpoint dir, preset (tiny, e2b, e4b, 12b, 31b), 'default' (the shipped pair, "
                         "its tokenizer and held-out prompts) or a named real pair, 'gemma-3-270m' (its GGUF, "
                         "its shipped drafter unless --assistant DIR, the drafter's held-out prompts)")
    ap.add_argument("--assistant", default=None, help="checkpoint dir or preset (default: same as --target)")
    ap.add_argument("--no-assistant", action="store_true")
    ap.add_argument("--draft", default="mtp", choices=("mtp", "ngram"),
                    help="the loop run's drafter: mtp (the assistant) or ngram (prompt lookup, no assistant loaded; "
                         "benchmarks/ngram_bench.py has the per-task-set numbers)")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N target layers (preset only)")
    ap.add_argument("--float", action="store_true", help="bf16 weights instead of 4-bit")
    ap.add_argument("--k-values", default="2,4", type=lambda s: _csv(s, int))
    ap.add_argument("--batch", default="1", type=lambda s: _csv(s, int))
    ap.add_argument("--verify-pad", default="off", dest="verify_pad_raw")
    ap.add_argument("--qmm-tile-m", default="16", type=lambda s: _csv(s, int))
    ap.add_argument("--pad-k-values", default="2,4", type=lambda s: _csv(s, int),
                    help="K values whose padded verify forward is timed in the forward run")
    ap.add_argument("--multirow", default="on", type=lambda s: _csv(s, _onoff))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--prompt-ids", default=None, help="JSON list of token ids")
    ap.add_argument("--prompts-file", default=None, help="JSON lines, one list of token ids per line")
    ap.add_argument("--prompts", default=None, metavar="FILE",
                    help="a JSON file of prompts: {\"prompts\": [...]} or a list, each a string, {\"text\": ...} "
                         "(tokenized with the target's tokenizer) or {\"ids\": [...]}, e.g. a drafter's "
                         "heldout_prompts.json (the default with a named pair)")
    ap.add_argument("--prompt", default=None, help="prompt text (needs a tokenizer: --tokenizer or the checkpoint's)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json for --prompt")
    ap.add_argument("--runs", default="forward,loop", type=lambda s: _csv(s))
    ap.add_argument("--each-prompt", action="store_true",
                    help="loop run: decode every prompt alone (B = 1) and sum the times and counts "
                         "(the default pair's held-out prompts, --prompts-file)")
    ap.add_argument("--scaling-batch", default="1,2,4,8,16,32", type=lambda s: _csv(s, int))
    ap.add_argument("--exactness-probe", default="on", type=_onoff,
                    help="off: run K as asked even where verify is not bit-identical to decode (with "
                         "multirow off at B=1 decode runs 1 row and verify K rows, so the probe falls "
                         "back to classic; off measures the round cost, parity column says what it cost)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; later configurations are skipped")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backend", default=None, choices=["pallas", "xla"],
                    help="matmul backend (default: pallas; on CPU that is slow interpret mode)")
    ap.add_argument("--devices", type=int, default=1,
                    help="split both models over this process's N devices (models.shard, tensor parallel); "
                         "N must be the device count (restrict it with CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--commit", default=None, help="the commit to name in the report (default: git rev-parse)")
    ap.add_argument("--out", default="out/speculative")
    ap.add_argument("--quiet", action="store_true", help="no progress bars (shown on stderr only when it is a terminal)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    args.verify_pad = [_onoff(v) for v in args.verify_pad_raw.split(",")]
    if args.each_prompt and args.batch != [1]:
        ap.error("--each-prompt decodes every prompt alone: it needs --batch 1")
    if args.draft == "ngram":
        args.no_assistant = True
    resolve_default_pair(args)
    resolve_named_pair(args)
    if args.prompt:
        args.prompt_tokens = tokenize_prompt(args)  # once, and before any model is built
    if args.prompts:
        args.text_prompt_ids, args.prompt_kinds = text_prompts(args)
    if args.assistant is None and not args.no_assistant:
        args.assistant = args.target
    if args.no_assistant:
        args.assistant = None
    bad_devices = devices_error(args.devices)
    if bad_devices:
        ap.error(bad_devices)
    os.makedirs(args.out, exist_ok=True)
    deadline = time.time() + args.time_budget
    dtype = jnp.dtype(args.dtype)
    t0 = time.time()
    matmul = DispatchConfig.from_env(**({"backend": args.backend} if args.backend else {}))
    target, assistant, what = load_pair(args, dtype, matmul)
    target, assistant = split_pair(target, assistant, args.devices)
    if args.devices > 1:
        what += f", split over {args.devices} devices"
    print(f"built {what} in {time.time() - t0:.1f}s", flush=True)
    env = environment(args.commit)
    meta = dict(what=what, env=env, command="python benchmarks/speculative_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
                args={k: v for k, v in vars(args).items()}, matmul=dataclasses.asdict(matmul),
                jaxspec_env={k: v for k, v in sorted(os.environ.items()) if k.startswith("JAXSPEC_")})
    rows: list[dict] = []
    wb = weight_bytes_per_token(target)
    meta["weight_bytes"] = wb
    if env["platform"] == "gpu":
        bw = hbm_bandwidth()
        meta["hbm_tbps"] = bw / 1e12
        meta["floor_ms"] = wb / (bw * args.devices) * 1e3  # each device streams its share
    try:
        fwd = None
        if "forward" in args.runs:
            fwd = run_forward(args, target, assistant, rows, deadline)
            if fwd and meta.get("floor_ms"):
                meta["decode_pct_of_floor"] = 100 * meta["floor_ms"] / (fwd * 1e3)
                print(f"decode forward {fwd * 1e3:.3f} ms = {meta['decode_pct_of_floor']:.1f}% of the "
                      f"weight-bytes floor ({meta['floor_ms']:.3f} ms)", flush=True)
        if "loop" in args.runs:
            run_loop(args, target, assistant, rows, deadline)
        if "scaling" in args.runs:
            run_scaling(args, target, rows, deadline)
    finally:
        write_report(args.out, meta, rows)
        print(open(os.path.join(args.out, "speculative.md")).read())


if __name__ == "__main__":
    main()
