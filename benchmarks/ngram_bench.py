"""ngram_bench: prompt-lookup (n-gram) drafting against classic decoding on task sets, one prompt at a time.

    python benchmarks/ngram_bench.py --target gemma-3-270m --k-values 4,8 --repeats 3 --out DIR
    python benchmarks/ngram_bench.py --target default --drafters ngram,mtp,hybrid --k-values 4 --out DIR

`--drafters` (default ngram): the drafters to run at each K, among ngram, mtp (the assistant) and
hybrid (prompt lookup where the row's last n-gram matches, else the assistant); mtp and hybrid need
`--assistant DIR` (a drafter trained for the target), or `--target default`, the shipped pair (its
assistant and tokenizer).

For each task set (benchmarks/tasks/*.json: code_edit, extract, prose) and each prompt, alone (B = 1),
greedy: classic decoding and n-gram drafting at every K, alternating within each repetition (the
machine may be shared: every configuration sees the same noise), decode time only (both halves are
compiled ahead of time; the prefill is excluded). Every prompt is padded to one prompt width and one
cache size, so each configuration is one compiled program whatever the prompt. Per set and K:
tokens per round, per-position acceptance, accepted drafts whose match continued in the prompt vs in
the model's own output, rounds with a match, decode tokens/s, speedup over classic (summed decode
time of the set), and whether every output is identical to classic's. The exactness probe (generate's
check that a K-wide verify equals K single steps, bit for bit) is run once per K and reported; the
runs themselves use the K asked. Writes DIR/ngram.json and DIR/ngram.md.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec import models  # noqa: E402
from jaxspec.engine import verify
from jaxspec.drafters import hybrid, mtp, ngram  # noqa: E402
from jaxspec.kernels import DispatchConfig  # noqa: E402
from jaxspec.engine.loop_config import CAPACITY_ROUND, PROMPT_BUCKET, round_up  # noqa: E402
from jaxspec.text import load_tokenizer  # noqa: E402

G = importlib.import_module("jaxspec.engine.generate")
TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
SETS = ("code_edit", "extract", "prose")
DRAFTERS = ("ngram", "mtp", "hybrid")


def load(args):
    """(target, assistant or None, tokenizer)."""
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    # None: the loader's rule (XLA on a CPU, the Pallas kernels on a GPU)
    matmul = DispatchConfig.from_env().replace(backend=args.backend) if args.backend else None
    if args.target == "default":
        from jaxspec.pairs import load_pair
        return load_pair("default", dtype, assistant=args.assistant, matmul=matmul)
    path = args.target
    if not os.path.exists(path):
        from jaxspec.models import gguf
        path = gguf.by_name(path)
    target = models.load_target(path, dtype=dtype, matmul=matmul)
    assistant = None if args.assistant is None else models.load_assistant(args.assistant, dtype=dtype, matmul=matmul,
                                                                           target=target)
    return target, assistant, load_tokenizer(path, None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="gemma-3-270m",
                    help="a checkpoint directory, a .gguf, a known name, or 'default' (the shipped pair)")
    ap.add_argument("--assistant", default=None, help="a drafter directory (mtp, hybrid)")
    ap.add_argument("--drafters", default="ngram", type=lambda s: s.split(","), help="among ngram, mtp, hybrid")
    ap.add_argument("--sets", default=",".join(SETS), help="task set names (benchmarks/tasks/NAME.json) or files")
    ap.add_argument("--k-values", default="4,8", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--n-min", type=int, default=ngram.N_MIN)
    ap.add_argument("--n-max", type=int, default=ngram.N_MAX)
    ap.add_argument("--hybrid-n-min", type=int, default=hybrid.N_MIN, help="the hybrid's shortest match")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=0, help="first N prompts of each set (0: all)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backend", default=None, choices=["pallas", "xla"])
    ap.add_argument("--out", default="out/ngram")
    args = ap.parse_args(argv)
    bad = [d for d in args.drafters if d not in DRAFTERS]
    if bad:
        raise SystemExit(f"--drafters: unknown {', '.join(bad)} (expected {', '.join(DRAFTERS)})")

    make = {"ngram": lambda: ngram.Drafter(n_min=args.n_min, n_max=args.n_max), "mtp": lambda: mtp.DEFAULT,
            "hybrid": lambda: hybrid.Drafter(n_min=args.hybrid_n_min, n_max=args.n_max)}
    drafters = {d: make[d]() for d in args.drafters}  # only those asked: their bounds are checked
    target, assistant, tok = load(args)
    if assistant is None and any(d.needs_params for d in drafters.values()):
        raise SystemExit("--drafters mtp / hybrid need --assistant DIR (or --target default)")
    sets = {}
    for name in args.sets.split(","):
        path = name if name.endswith(".json") else os.path.join(TASKS, f"{name}.json")
        with open(path) as f:
            body = json.load(f)
        prompts = body["prompts"][:args.limit or None]
        sets[body["name"]] = [tok.encode(p) for p in prompts]
    width = round_up(max(len(ids) for rows in sets.values() for ids in rows), PROMPT_BUCKET)
    cache = round_up(width + args.max_tokens + max(args.k_values) + 16, CAPACITY_ROUND)
    stop = tuple(tok.eos_token_ids)
    configs = [("classic", 1, None)] + [(f"{d} K={k}", k, d) for d in args.drafters for k in args.k_values]
    gens = {name: jaxspec.make_generate(block_size=k, max_new_tokens=args.max_tokens, cache_size=cache,
                                        drafter=drafters[d] if k > 1 else None) for name, k, d in configs}
    params = {name: assistant if d and drafters[d].needs_params else None for name, _, d in configs}
    probes = {k: verify.exactness_probe(target, 1, k, verify.verify_width(k, 1, False, target.matmul))
              for k in args.k_values}
    print(f"prompt width {width}, cache {cache}; exactness probe at B=1: {probes}", file=sys.stderr)

    def run(name, ids):
        gen = gens[name]
        inputs = gen.inputs([ids], eos_token_ids=stop, prompt_width=width)
        state, _, decode_s = gen.run(target, params[name], *inputs)
        plan = G.Plan(gen=gen, params=params[name], inputs=inputs, batch=1,
                                                   verify_width=gen.spec.block_size, fallback=None,
                                                   probe_logit_diff=None)
        return plan.result(state, 0.0, decode_s)

    t0 = time.perf_counter()
    for rows in sets.values():  # compile every program (one per configuration) and warm up
        for name, _, _ in configs:
            run(name, rows[0])
    compile_s = time.perf_counter() - t0
    load_before = os.getloadavg()
    acc = {(s, name): dict(decode_s=[], tokens=0, row_rounds=0, hist=None, draft=None, identical=True, texts=[])
           for s in sets for name, _, _ in configs}
    for rep in range(args.repeats):
        for s, rows in sets.items():
            for i, ids in enumerate(rows):
                ref = None
                for name, _, _ in configs:
                    r = run(name, ids)
                    a = acc[(s, name)]
                    st = r.stats
                    if len(a["decode_s"]) <= i:
                        a["decode_s"].append([])
                    a["decode_s"][i].append(st.decode_s)
                    if ref is None:
                        ref = r.tokens[0]
                    a["identical"] &= r.tokens[0] == ref
                    if rep == 0:
                        a["tokens"] += st.new_tokens - 1
                        a["row_rounds"] += st.row_rounds
                        a["hist"] = st.accepted_hist if a["hist"] is None else [x + y for x, y in
                                                                                 zip(a["hist"], st.accepted_hist)]
                        a["draft"] = st.draft_stats if a["draft"] is None else {
                            k: a["draft"][k] + v for k, v in st.draft_stats.items()}
                        a["texts"].append(len(r.tokens[0]))
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    load_after = os.getloadavg()

    rows_out = []
    for s in sets:
        base = sum(statistics.median(t) for t in acc[(s, "classic")]["decode_s"])
        for name, k, _ in configs:
            a = acc[(s, name)]
            dec = sum(statistics.median(t) for t in a["decode_s"])  # per prompt: the median repetition
            hist = a["hist"] or [0]
            rr = a["row_rounds"]
            row = dict(set=s, config=name, k=k, prompts=len(sets[s]), new_tokens=a["tokens"], row_rounds=rr,
                       tokens_per_round=a["tokens"] / rr if rr else 0.0, decode_s=dec,
                       decode_tokens_per_s=a["tokens"] / dec if dec else 0.0, speedup=base / dec if dec else 0.0,
                       identical=a["identical"], accepted_hist=hist,
                       position_acceptance=[sum(hist[i:]) / rr for i in range(1, len(hist))] if rr else [],
                       draft_stats=a["draft"] or {})
            rows_out.append(row)
    meta = dict(target=args.target, assistant=args.assistant, drafters=args.drafters, dtype=args.dtype,
                backend=target.matmul.describe, max_tokens=args.max_tokens,
                repeats=args.repeats, n_min=args.n_min, n_max=args.n_max, hybrid_n_min=args.hybrid_n_min,
                prompt_width=width, cache=cache,
                probe_b1={str(k): [bool(v[0]), float(v[1])] for k, v in probes.items()}, compile_s=compile_s,
                loadavg_before=load_before, loadavg_after=load_after, cpu=platform.processor() or platform.machine(),
                cores=os.cpu_count(), jax=jax.__version__, device=str(jax.devices()[0]),
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                      text=True).stdout.strip(), command=" ".join(sys.argv))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ngram.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows_out), f, indent=1)
    hybrid_n = f" (hybrid: {args.n_max}..{drafters['hybrid'].n_min})" if "hybrid" in args.drafters else ""
    lines = [f"# n-gram drafting vs classic ({args.target}, {meta['backend']}, {args.dtype}, B = 1, greedy)", "",
             f"`{meta['command']}` at {meta['commit']}; n = {args.n_max}..{args.n_min}{hybrid_n}; load average "
             f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; {args.repeats} repetitions, per prompt the "
             f"median; exactness probe at B = 1: {meta['probe_b1']}", "",
             "| set | config | tokens | tokens/round | per-position acceptance | accepted from prompt / output | "
             "matched rounds | assisted rounds | decode tok/s | speedup | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        d = r["draft_stats"]
        lines.append(f"| {r['set']} | {r['config']} | {r['new_tokens']} | {r['tokens_per_round']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in r['position_acceptance'])} | "
                     f"{d.get('accepted_from_prompt', '')} / {d.get('accepted_from_output', '')} | "
                     f"{d.get('matched_rounds', '')} | {d.get('assisted_rounds', '')} | "
                     f"{r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    with open(os.path.join(args.out, "ngram.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
