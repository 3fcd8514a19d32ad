"""cold_start_bench: what a new process waits before its first token, and which programs it compiles.

    python benchmarks/cold_start_bench.py --target tiny --layers 6,12,24,48 --out DIR        (CPU scaling)
    python benchmarks/cold_start_bench.py --target 12b --assistant 12b --block-size 1,4 \
        --disk-cache warm --out DIR                                                       (the H200 row)

Each measurement is a fresh Python process (nothing compiled in memory): build or load the models
(`--model DIR` / `--assistant-dir DIR` load checkpoints, else random weights of the preset), then
`jaxspec.generate` twice on two random prompts of --prompt-len tokens: the first call's seconds
(compilation included), the second's, and the programs the first compiled (name, trace + lower s,
compile s; `jaxspec.engine.compile_cache.CompileLog`). --disk-cache: "off" (no on-disk cache), "cold" (a
new empty cache directory), "warm" (a cold run, then the same command again in a new process on the
cache it filled). Writes DIR/cold_start.json and DIR/cold_start.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HERE = os.path.dirname(os.path.abspath(__file__))


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def child(args) -> dict:
    """One measurement, in this (fresh) process."""
    sys.path[:0] = [ROOT, HERE]
    import jax
    import numpy as np

    from jaxspec import models
    from harness import Q4, random_pair
    from jaxspec.engine import compile_cache
    from jaxspec import generate
    from jaxspec.kernels import DispatchConfig

    matmul = DispatchConfig.from_env(**({"backend": args.backend} if args.backend else {}))

    if args.cache_dir:
        compile_cache.enable(args.cache_dir)
    else:
        compile_cache.disable_default()
    t0 = time.perf_counter()
    if args.model:
        target = models.load_target(args.model, quantize=Q4, matmul=matmul)
        assistant = (models.load_assistant(args.assistant_dir, quantize=Q4, target=target, matmul=matmul)
                     if args.assistant_dir else None)
    else:
        target, assistant = random_pair(args.target, args.assistant, layers=args.layers, matmul=matmul)
    jax.block_until_ready(jax.tree_util.tree_leaves(target))
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = target.config.vocab_size
    calls = []
    for i in range(2):
        prompt = rng.integers(3, vocab, args.prompt_len).tolist()
        with compile_cache.CompileLog() as log:
            t1 = time.perf_counter()
            out = generate(target, [prompt], assistant=assistant if args.block_size > 1 else None,
                           max_new_tokens=args.max_tokens, block_size=args.block_size, eos_token_ids=())
            call_s = time.perf_counter() - t1
        calls.append(dict(seconds=call_s, tokens=len(out.tokens[0]), ids=out.tokens[0], fallback=out.stats.fallback,
                          cache_hits=log.cache_hits,
                          programs=[dict(name=p.name, trace_lower_s=p.trace_s + p.lower_s, compile_s=p.compile_s,
                                         load_s=p.load_s) for p in log.programs if p.compile_s or p.load_s]))
    return dict(load_s=load_s, first=calls[0], second=calls[1])


def measure(args, layers, k, cache_dir) -> dict:
    """Run `child` in a new process and return its row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--target", args.target,
           "--layers", str(layers), "--block-size", str(k), "--prompt-len", str(args.prompt_len),
           "--max-tokens", str(args.max_tokens)]
    for flag, val in (("--assistant", args.assistant), ("--model", args.model), ("--backend", args.backend),
                      ("--assistant-dir", args.assistant_dir), ("--cache-dir", cache_dir)):
        if val:
            cmd += [flag, val]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode:
        raise RuntimeError(f"child failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def write(out, meta, rows):
    from harness import write_report
    lines = [f"# Cold start: {meta['what']}", "", meta["env"], "", f"Command: `{meta['command']}`", "",
             "| layers | K | disk cache | load s | first call s | second call s | programs (trace+lower / compile s, or loaded s) | cache hits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        progs = ", ".join(f"{p['name']} loaded {p['load_s']:.1f}" if p.get("load_s") else
                          f"{p['name']} {p['trace_lower_s']:.1f}/{p['compile_s']:.1f}" for p in r["first"]["programs"]
                          if p["compile_s"] >= 0.2 or p.get("load_s"))
        lines.append(f"| {r['layers'] or 'all'} | {r['k']} | {r['disk_cache']} | {r['load_s']:.1f} | "
                     f"{r['first']['seconds']:.1f} | {r['second']['seconds']:.2f} | {progs} | {r['first']['cache_hits']} |")
    write_report(out, "cold_start", meta, rows, lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tiny", help="a preset name or tiny (random weights)")
    ap.add_argument("--assistant", default=None, help="an assistant preset (or tiny) for K > 1")
    ap.add_argument("--model", default=None, help="load the target from this checkpoint instead")
    ap.add_argument("--assistant-dir", default=None)
    ap.add_argument("--backend", choices=("pallas", "xla"), default=None,
                    help="the models' matmul backend (default: DispatchConfig.from_env())")
    ap.add_argument("--layers", default="0", help="comma list: target layers (0: the preset's)")
    ap.add_argument("--block-size", default="1", help="comma list of K (1: classic)")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--disk-cache", choices=("off", "cold", "warm"), default="off")
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="cold_start_out")
    args = ap.parse_args(argv)
    if args.child:
        args.layers, args.block_size = int(args.layers), int(args.block_size)
        print(json.dumps(child(args)), flush=True)
        return None
    sys.path[:0] = [HERE]
    from harness import environment_line

    os.makedirs(args.out, exist_ok=True)
    meta = dict(what=f"{args.target} target" + (f", {args.assistant} assistant" if args.assistant else "")
                + (f", backend {args.backend}" if args.backend else "")
                + f", {args.prompt_len}-token prompt, {args.max_tokens} new tokens",
                env=environment_line(args.commit),
                command="python benchmarks/cold_start_bench.py " + " ".join(sys.argv[1:] if argv is None else argv))
    rows = []
    for layers in _ints(args.layers):
        for k in _ints(args.block_size):
            runs = [("off", None)]
            if args.disk_cache != "off":
                d = tempfile.mkdtemp(prefix="jaxspec-cold-")
                runs = [("cold", d)] + ([("warm", d)] if args.disk_cache == "warm" else [])
            for mode, d in runs:
                row = dict(layers=layers, k=k, disk_cache=mode, **measure(args, layers, k, d))
                rows.append(row)
                print(json.dumps(row), flush=True)
                write(args.out, meta, rows)
    return rows


if __name__ == "__main__":
    main()
