"""context_bench: prefill and decode cost against context length (the long-context issue's sweep).

    python benchmarks/context_bench.py --target 12b --context 128,2048,8192,32768,131072 \
        --max-tokens 64 --spec-context 16384,32768 --out DIR

For each prompt length L (B = 1, random 4-bit weights, random prompt ids): classic greedy
`jaxspec.plan` + its compiled prefill and decode, the best of --repeats runs (compilation excluded):
prefill s, prefill tok/s, decode tok/s (--max-tokens new tokens, the first counted), and the device's
peak memory after the length (lengths run in increasing order, so each peak is that length's, or a
shorter one's when that was higher). For each --spec-context length with --assistant: a K = 4
speculative run on the same prompt, its greedy output against classic, the exactness probe's verdict
(no fallback) and the round cost in classic decode steps. --attention xla runs the XLA attention
(the reference) instead of the Pallas kernels for an A/B; --backend picks the matmul path (auto: the
kernels on a GPU, XLA elsewhere). Writes DIR/context.json, DIR/context.md
and DIR/context.png after every length, so a run cut short keeps what finished.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxspec import models  # noqa: E402
from harness import environment_line, random_pair, write_report  # noqa: E402
from jaxspec.kernels import DispatchConfig  # noqa: E402
from jaxspec.kernels.config import BACKEND_CHOICES  # noqa: E402

from jaxspec.engine.generate import plan, request_of  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def build(args):
    # "auto" (resolve_backend): the Pallas kernels on a GPU; elsewhere XLA (the kernels' interpreter
    # times nothing real and compiled a tiny sweep ~2.4x slower on the CPU)
    return random_pair(args.target, args.assistant, layers=args.layers, seed=args.seed,
                       matmul=DispatchConfig.from_env(attention=args.attention, backend=args.backend))


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def timed(target, assistant, prompt, args, block_size):
    """(tokens, best prefill s, best decode s, state, plan) over --repeats runs after a warm-up."""
    p = plan(target, [prompt], request_of(max_new_tokens=args.max_tokens), assistant=assistant,
             block_size=block_size, eos_token_ids=())
    best_pre = best_dec = float("inf")
    state = None
    for i in range(args.repeats + 1):  # run 0 compiles
        state, pre_s, dec_s = p.gen.run(target, p.params, *p.inputs)
        if i:
            best_pre, best_dec = min(best_pre, pre_s), min(best_dec, dec_s)
    return p.gen.tokens(state)[0], best_pre, best_dec, state, p


def one_length(target, assistant, n, args, rng) -> dict:
    prompt = rng.integers(3, target.config.vocab_size, size=n).tolist()
    t0 = time.perf_counter()
    toks, pre_s, dec_s, _, _ = timed(target, None, prompt, args, 1)
    row = dict(context=n, prefill_s=pre_s, prefill_tok_s=n / pre_s, decode_tok_s=len(toks) / dec_s,
               decode_step_ms=1e3 * dec_s / len(toks), peak_gib=(peak_bytes() or 0) / 2**30,
               wall_s=time.perf_counter() - t0)
    if assistant is not None and n in args.spec_context:
        stoks, _, sdec_s, state, p = timed(target, assistant, prompt, args, 4)
        rounds = int(jax.device_get(state.rounds))
        row.update(spec_greedy_equal=stoks == toks, spec_block=p.gen.spec.block_size, spec_fallback=p.fallback,
                   spec_round_fwd=(sdec_s / rounds) / (dec_s / len(toks)), spec_rounds=rounds)
    return row


def write(out, meta, rows):
    base = rows[0]["decode_tok_s"] if rows else None
    lines = [f"# Context sweep: {meta['what']}", "", f"{meta['env']}", "", f"Command: `{meta['command']}`", "",
             "| context | prefill s | prefill tok/s | decode tok/s | vs first | step ms | peak GiB | K=4 round (fwd) | K=4 greedy == classic |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spec = (f"{r['spec_round_fwd']:.2f} (K={r['spec_block']}{', ' + r['spec_fallback'] if r['spec_fallback'] else ''})"
                if "spec_round_fwd" in r else "")
        lines.append(f"| {r['context']:,} | {r['prefill_s']:.3f} | {r['prefill_tok_s']:,.0f} | {r['decode_tok_s']:.1f} | "
                     f"{r['decode_tok_s'] / base:.0%} | {r['decode_step_ms']:.2f} | {r['peak_gib']:.1f} | {spec} | "
                     f"{r.get('spec_greedy_equal', '')} |")
    write_report(out, "context", meta, rows, lines)
    plot(out, meta, rows)


def plot(out, meta, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    xs = [r["context"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [r["decode_tok_s"] for r in rows], "o-")
    a.set(xscale="log", xlabel="context (tokens)", ylabel="decode tok/s", ylim=(0, None), title="decode")
    b.plot(xs, [r["prefill_tok_s"] for r in rows], "o-")
    b.set(xscale="log", xlabel="prompt (tokens)", ylabel="prefill tok/s", ylim=(0, None), title="prefill")
    fig.suptitle(meta["what"], fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "context.png"), dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="12b", choices=sorted(models.presets.TARGETS) + ["tiny"])
    ap.add_argument("--assistant", default=None, help="an assistant preset for the --spec-context runs")
    ap.add_argument("--layers", type=int, default=0, help="only the first N layers (a quick slice)")
    ap.add_argument("--context", type=_ints, default=_ints("128,2048,8192,32768,131072"))
    ap.add_argument("--spec-context", type=_ints, default=[])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--attention", choices=("auto", "xla"), default="auto")
    ap.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                    help="the matmul path (auto: pallas on a GPU, else xla)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default="")
    ap.add_argument("--time-budget", type=float, default=0, help="skip lengths once this many s have passed")
    ap.add_argument("--out", default="context_out")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    target, assistant = build(args)
    what = (f"preset {args.target}" + (f" (first {args.layers} layers)" if args.layers else "")
            + f", random 4-bit weights, B = 1, greedy, {args.max_tokens} new tokens, attention {args.attention}, "
            f"matmul {target.matmul.backend}")
    meta = dict(what=what, env=environment_line(args.commit), command="python benchmarks/context_bench.py "
                + " ".join(sys.argv[1:] if argv is None else argv), build_s=time.perf_counter() - t0)
    rng = np.random.default_rng(args.seed)
    rows = []
    for n in sorted(args.context):
        if args.time_budget and time.perf_counter() - t0 > args.time_budget:
            print(f"time budget spent: skipping {n}", flush=True)
            continue
        rows.append(one_length(target, assistant, n, args, rng))
        print(json.dumps(rows[-1]), flush=True)
        write(args.out, meta, rows)
    return rows


if __name__ == "__main__":
    main()
