"""prefix_bench: time to first token of requests that share a long prompt prefix, prefix reuse on
against off (issue 70), on the batch engine the server runs (`jaxspec.engine.batching.BatchEngine`).

    python benchmarks/prefix_bench.py --target 12b --prefix-len 16384,4096 --out DIR     # the H200 workload
    python benchmarks/prefix_bench.py --target tiny --layers 2 --prefix-len 256 --suffix-len 16 \
        --requests 3 --prefill-chunk 64 --out DIR                                        # a CPU smoke run

Per prefix length P and reuse setting (off first, then on, each a fresh engine of the same shape):
one request with a random P-token prefix and a 64-token (--suffix-len) suffix primes the engine
(reuse on: its blocks and ring snapshot are cached), then --requests requests with the same prefix
and fresh random suffixes run one after another. A request's time to first token is its admission
to the step that reports its first token (every chunk of its prompt that is not found cached, and
the step's dispatch; chunks of --prefill-chunk, default 512, the server's default 128). Reported:
the median and each request's TTFT, reuse on / off (the issue's bar: <= 25%), the prompt tokens
found cached, the primer's TTFT. Compilation is excluded: a warm-up
request of another prefix runs first (its chunks compile the prefill, its steps the decode, and with
reuse on a second one with its prefix compiles the hit's programs). Writes DIR/prefix.json and
DIR/prefix.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import environment, environment_line, random_pair, write_report  # noqa: E402

from jaxspec.engine.batching import BatchEngine  # noqa: E402
from jaxspec.kernels import DispatchConfig  # noqa: E402
from jaxspec.kernels.config import BACKEND_CHOICES  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def first_token_s(engine: BatchEngine, ids: list[int], max_tokens: int) -> float:
    """Admit one request into an idle engine, step until its first token is reported, then until it
    ends; seconds from admission to that first report."""
    t0 = time.perf_counter()
    engine.admit(ids, max_tokens, seed=0)
    ttft = None
    while engine.live:
        for ev in engine.step():
            if ev.tokens and ttft is None:
                ttft = time.perf_counter() - t0
    engine.step()  # the idle step after the last report: the engine is empty for the next request
    return ttft


def run(target, assistant, args, prefix_len: int, reuse: bool, rng) -> dict:
    k, block = args.block_size, args.block_tokens
    n_prompt = prefix_len + args.suffix_len
    capacity = -(-(n_prompt + args.max_tokens + 2 * 16) // block) * block
    engine = BatchEngine(target, assistant if k > 1 else None, slots=1, max_new_tokens=args.max_tokens,
                         capacity=capacity, block_size=k, eos_token_ids=(), block_tokens=block,
                         prefill_chunk=args.prefill_chunk, prefix_cache=reuse)
    vocab = target.config.vocab_size
    fresh = lambda n: rng.integers(2, vocab, n).tolist()  # noqa: E731
    t = time.perf_counter()
    warm = fresh(prefix_len)
    for _ in range(2 if reuse else 1):  # compile (with reuse: the second one hits)
        first_token_s(engine, warm + fresh(args.suffix_len), args.max_tokens)
    compile_s = time.perf_counter() - t
    prefix = fresh(prefix_len)
    primer = first_token_s(engine, prefix + fresh(args.suffix_len), args.max_tokens)
    hit0 = engine.pool.hit
    ttfts = [first_token_s(engine, prefix + fresh(args.suffix_len), args.max_tokens) for _ in range(args.requests)]
    return dict(prefix_len=prefix_len, suffix_len=args.suffix_len, reuse=reuse, k=engine.block_size,
                prefill_chunk=engine.prefill_chunk, requests=args.requests, primer_ttft_s=primer,
                ttft_s=ttfts, ttft_median_s=statistics.median(ttfts),
                hit_tokens_per_request=(engine.pool.hit - hit0) / args.requests, warm_up_s=compile_s,
                snapshots=0 if engine.snaps is None else engine.snaps.taken)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="12b", help="a preset name, or 'tiny' (with --layers)")
    ap.add_argument("--assistant", default=None, help="the assistant's preset (default: none, K = 1)")
    ap.add_argument("--layers", type=int, default=0, help="keep the preset's first N layers (0: all)")
    ap.add_argument("--prefix-len", type=_ints, default=[16384, 4096], help="shared prefix lengths")
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="timed requests per configuration")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=1, help="K (an assistant needed for K > 1)")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.block_size > 1 and not args.assistant:
        raise SystemExit("--block-size > 1 needs --assistant")
    os.makedirs(args.out, exist_ok=True)
    target, assistant = random_pair(args.target, args.assistant, layers=args.layers,
                                    matmul=DispatchConfig.from_env(backend=args.backend), seed=args.seed)
    rng = np.random.default_rng(args.seed)
    rows = []
    for p in args.prefix_len:
        off, on = (run(target, assistant, args, p, reuse, rng) for reuse in (False, True))
        on["ratio"] = on["ttft_median_s"] / off["ttft_median_s"]
        rows += [off, on]
        print(f"prefix {p} + {args.suffix_len}: TTFT median off {off['ttft_median_s'] * 1e3:.1f} ms, on "
              f"{on['ttft_median_s'] * 1e3:.1f} ms ({on['ratio']:.1%}), {on['hit_tokens_per_request']:.0f} tokens "
              f"found per request", flush=True)
    lines = [f"# prefix_bench — preset {args.target}, random 4-bit weights", "", environment_line(args.commit), "",
             f"Command: `python benchmarks/prefix_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"One slot, K = {args.block_size}, prefill chunk {args.prefill_chunk}, blocks of {args.block_tokens}; "
             f"per prefix: a primer request, then {args.requests} requests (the prefix + a fresh "
             f"{args.suffix_len}-token suffix, {args.max_tokens} new tokens) one after another.", "",
             "| prefix | reuse | TTFT median ms | TTFT min / max ms | on / off | tokens found per request | "
             "primer TTFT ms | snapshots taken |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.1%}" if "ratio" in r else ""
        lines.append(f"| {r['prefix_len']} | {'on' if r['reuse'] else 'off'} | {r['ttft_median_s'] * 1e3:.1f} | "
                     f"{min(r['ttft_s']) * 1e3:.1f} / {max(r['ttft_s']) * 1e3:.1f} | {ratio} | "
                     f"{r['hit_tokens_per_request']:.0f} | {r['primer_ttft_s'] * 1e3:.1f} | {r['snapshots']} |")
    write_report(args.out, "prefix", dict(environment(args.commit), args=vars(args)), rows, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
