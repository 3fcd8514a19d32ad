"""attention_bench: the Pallas attention kernels against XLA's at the 12B's shapes, with tunings.

    python benchmarks/attention_bench.py --out DIR [--decode-tunings "split=512,block_k=64;..."]
        [--flash-tunings "block_q=64,block_k=64,num_warps=4;..."] [--contexts 1024,32768,131072]
    python benchmarks/attention_bench.py --ops paged --out DIR [--slots 32 --capacity 4096 --block 16] [--tiny]

decode: `decode_attention` (T = 1 and 4) against `dense_attention` (the XLA path) on the 12B's two
layer kinds: sliding (16 query heads, 8 KV heads, head dim 256, a ring of 1,041 slots, window 1,024)
and global (16 / 1, head dim 512, the cache filled to each context); time and the rate at which the
visible K/V bytes are read. prefill: `flash_attention` against `blocked_attention` for a prompt of
each --prefill length, both kinds (causal, and window 1,024), time and TFLOP/s over the visible
pairs. paged: decode attention over a paged KV pool (`jaxspec serve`'s cache) at the global
layer's shapes, --slots rows of --capacity slots in blocks of --block: `paged_attention` (each
row's blocks read through its table) against the gather path (every row's whole capacity gathered
into a view, then `decode_attention`: the model's path before paged_attention, which also scattered
the new K/V back, not timed here) and the XLA reference (the gather, then `dense_attention`), for
T = 1 and 4, every row nearly full and ragged lengths; the rate counts the visible K/V bytes (one
pool of 256 MiB at the defaults: read from HBM). --tiny: the same at toy shapes, the kernels in
interpret mode where there is no GPU (a test runs it). Every kernel result is checked against the
XLA path first. Medians of synchronised calls (benchmarks/harness.py); decode runs one call over
enough K/V copies to pass the L2 several times (the time per copy is reported, the call's fixed
cost included), so the cache is read from HBM. Writes DIR/attention.json and DIR/attention.md and
prints the table.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import environment_line, median_time, write_report  # noqa: E402
from jaxspec.kernels.decode_attention import decode_attention, dense_attention, visible  # noqa: E402
from jaxspec.kernels.flash_attention import blocked_attention, flash_attention  # noqa: E402
from jaxspec.kernels.paged_attention import paged_attention, paged_attention_reference, paged_view  # noqa: E402

EMPTY = int(np.iinfo(np.int32).max)
KINDS = {  # name: (query heads, kv heads, head dim, window)
    "sliding": (16, 8, 256, 1024),
    "global": (16, 1, 512, None),
}
RING = 1041


def _tunings(s: str) -> list[dict]:
    out = []
    for item in s.split(";"):
        item = item.strip()
        out.append({k: int(v) for k, v in (kv.split("=") for kv in item.split(",") if kv)} if item else {})
    return out


def _rand(key, shape, dtype=jnp.bfloat16):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def decode_case(kind: str, context: int, t: int, key):
    """(q, k, v, q_pos, k_pos, window, visible K/V bytes) for a decode / verify of t queries."""
    hq, hkv, d, window = KINDS[kind]
    ks = jax.random.split(key, 3)
    if kind == "sliding":
        c = RING
        pos = np.arange(context + t - c, context + t)  # the ring's newest positions, slot = p mod c
        k_pos = np.full(c, EMPTY, np.int64)
        k_pos[pos[pos >= 0] % c] = pos[pos >= 0]
        visible = min(window, context + t)
    else:
        c = context + 64
        k_pos = np.arange(c)
        visible = context + t
    q_pos = jnp.asarray([np.arange(context, context + t)], jnp.int32)
    q = _rand(ks[0], (1, t, hq, d))
    k, v = _rand(ks[1], (1, c, hkv, d)), _rand(ks[2], (1, c, hkv, d))
    return q, k, v, q_pos, jnp.asarray(k_pos[None], jnp.int32), window, 2 * visible * hkv * d * 2


def check(got, ref, what):
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    ok = err <= 2e-2 * max(scale, 1e-6)
    print(f"  check {what}: max err {err:.3g} (scale {scale:.3g}) {'ok' if ok else 'MISMATCH'}", flush=True)
    return ok


def bench_decode(args, rows):
    for kind in KINDS:
        for context in args.contexts:
            for t in (1, 4):
                q, k, v, qp, kp, w, nbytes = decode_case(kind, context, t, jax.random.key(context + t))
                # enough K/V copies to pass the 60 MB L2 several times: each call reads from HBM
                sets = max(1, min(16, -(-256 * 2**20 // (2 * k.size * k.dtype.itemsize))))
                kvs = [(k * (1 + i / 64), v * (1 - i / 64)) for i in range(sets)]

                def many(attn):
                    return jax.jit(lambda q, kvs, qp, kp: [attn(q, k_, v_, qp, kp) for k_, v_ in kvs])

                dense = lambda q, k_, v_, qp, kp: dense_attention(q, k_, v_, visible(qp, kp, w))  # noqa: E731
                ref = jax.jit(dense)(q, k, v, qp, kp)
                variants = [("xla dense", dense)] + [
                    (f"pallas {tu or 'defaults'}", functools.partial(
                        lambda q, k_, v_, qp, kp, tu: decode_attention(q, k_, v_, qp, kp, w, **tu).reshape(ref.shape),
                        tu=tu)) for tu in args.decode_tunings]
                for name, attn in variants:
                    try:
                        ok = check(jax.jit(attn)(q, k, v, qp, kp), ref, f"decode {kind} {context} T={t} {name}")
                        s = median_time(many(attn), q, kvs, qp, kp, warmup=2, repeats=args.repeats) / sets
                    except Exception as e:  # a tuning Triton rejects: report, go on
                        print(f"  {kind} {context} T={t} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                        continue
                    rows.append(dict(op="decode", kind=kind, context=context, t=t, variant=name, ok=ok,
                                     us=s * 1e6, gbs=nbytes / s / 1e9))
                    print(json.dumps(rows[-1]), flush=True)


def bench_prefill(args, rows):
    for kind in KINDS:
        hq, hkv, d, window = KINDS[kind]
        for n in args.prefill:
            ks = jax.random.split(jax.random.key(n), 3)
            q, k, v = _rand(ks[0], (1, n, hq, d)), _rand(ks[1], (1, n, hkv, d)), _rand(ks[2], (1, n, hkv, d))
            pos = jnp.arange(n, dtype=jnp.int32)[None]
            pairs = sum(min(i + 1, window or n) for i in range(n))
            flops = 4 * pairs * hq * d
            ref_fn = jax.jit(lambda q, k, v, p: blocked_attention(q, k, v, p, p, window))
            variants = [(f"pallas {tu or 'defaults'}", jax.jit(functools.partial(
                lambda q, k, v, p, tu: flash_attention(q, k, v, p, p, window, **tu).reshape(q.shape[0], q.shape[1], -1),
                tu=tu))) for tu in args.flash_tunings]
            ref = None
            if n <= args.xla_prefill_max:
                variants.insert(0, ("xla blocked", ref_fn))
                ref = ref_fn(q, k, v, pos)
            for name, fn in variants:
                try:
                    out = fn(q, k, v, pos)
                    ok = check(out, ref, f"prefill {kind} {n} {name}") if ref is not None else None
                    s = median_time(fn, q, k, v, pos, warmup=1, repeats=max(3, args.repeats // 2))
                except Exception as e:
                    print(f"  prefill {kind} {n} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                rows.append(dict(op="prefill", kind=kind, context=n, variant=name, ok=ok, ms=s * 1e3,
                                 tflops=flops / s / 1e12))
                print(json.dumps(rows[-1]), flush=True)


def paged_case(args, lengths: np.ndarray, t: int, key):
    """(q, k_pool, v_pool, table, lengths, q_pos): each row owns the blocks its length needs, in a
    random order over a pool of exactly the slots' capacity; table entries past them name no block."""
    hq, hkv, d, _ = args.paged_shape
    b, page = len(lengths), args.block
    nb = args.capacity // page
    pool = b * nb
    perm = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1))).permutation(pool)
    table = np.full((b, nb), pool, np.int32)
    for r, n in enumerate(lengths):
        table[r, :-(-int(n) // page)] = perm[r * nb:r * nb + -(-int(n) // page)]
    ks = jax.random.split(key, 3)
    q = _rand(ks[0], (b, t, hq, d))
    kp, vp = _rand(ks[1], (pool, page, hkv, d)), _rand(ks[2], (pool, page, hkv, d))
    q_pos = jnp.asarray(lengths[:, None] - t + np.arange(t)[None, :], jnp.int32)
    return q, kp, vp, jnp.asarray(table), jnp.asarray(lengths, jnp.int32), q_pos


def bench_paged(args, rows):
    hq, hkv, d, window = args.paged_shape
    b, c = args.slots, args.capacity
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(args.seed)
    scenarios = {"nearly full": np.full(b, c - 8), "ragged": rng.integers(1, c + 1, b)}
    slots = jnp.arange(c, dtype=jnp.int32)[None, :]

    def gathered(q, kp, vp, table, lengths, q_pos):  # today's path: the rows' views, then decode_attention
        k_pos = jnp.broadcast_to(slots, (q.shape[0], c))
        return decode_attention(q, paged_view(kp, table), paged_view(vp, table), q_pos, k_pos, window,
                                interpret=interpret)

    variants = [("xla gather + dense", lambda *a: paged_attention_reference(*a, window)),
                ("gather + decode_attention", gathered),
                ("paged_attention", lambda *a: paged_attention(*a, window, interpret=interpret))]
    for scenario, lengths in scenarios.items():
        lengths = np.maximum(lengths, 4)
        for t in (1, 4):
            case = paged_case(args, lengths, t, jax.random.key(args.seed + t))
            nbytes = 2 * int(lengths.sum()) * hkv * d * 2
            ref = jax.jit(variants[0][1])(*case)
            for name, fn in variants:
                fn = jax.jit(fn)
                try:
                    ok = check(fn(*case), ref, f"paged {scenario} T={t} {name}")
                    sec = median_time(fn, *case, warmup=2, repeats=args.repeats)
                except Exception as e:
                    print(f"  paged {scenario} T={t} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                rows.append(dict(op="paged", kind=f"global, {b} slots {scenario}", context=c, t=t, variant=name,
                                 ok=ok, us=sec * 1e6, gbs=nbytes / sec / 1e9))
                print(json.dumps(rows[-1]), flush=True)


def write(out, meta, rows):
    lines = [f"# Attention kernels: {meta['env']}", "", f"Command: `{meta['command']}`", "",
             "| op | kind | context | T | variant | check | time | rate |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        time_s = f"{r['us']:.1f} us" if "us" in r else f"{r['ms']:.2f} ms"
        rate = f"{r['gbs']:.0f} GB/s" if "gbs" in r else f"{r['tflops']:.0f} TFLOP/s"
        lines.append(f"| {r['op']} | {r['kind']} | {r['context']:,} | {r.get('t', '')} | {r['variant']} | "
                     f"{r['ok']} | {time_s} | {rate} |")
    write_report(out, "attention", meta, rows, lines)
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 32768, 131072])
    ap.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    ap.add_argument("--xla-prefill-max", type=int, default=8192, help="longest prompt the XLA path also runs")
    ap.add_argument("--decode-tunings", type=_tunings, default=[{}])
    ap.add_argument("--flash-tunings", type=_tunings, default=[{}])
    ap.add_argument("--ops", default="decode,prefill")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--slots", type=int, default=32, help="paged: rows of the pool")
    ap.add_argument("--capacity", type=int, default=4096, help="paged: slots a row may hold")
    ap.add_argument("--block", type=int, default=16, help="paged: positions per pool block")
    ap.add_argument("--seed", type=int, default=0, help="paged: the random lengths, tables and values")
    ap.add_argument("--tiny", action="store_true",
                    help="paged at toy shapes (2 slots of 64, blocks of 8, 4 query heads, 1 KV head of 32)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="attention_out")
    args = ap.parse_args(argv)
    args.paged_shape = KINDS["global"]
    if args.tiny:
        args.slots, args.capacity, args.block, args.repeats, args.paged_shape = 2, 64, 8, 1, (4, 1, 32, None)
    if args.capacity % args.block or args.slots < 1:
        ap.error(f"--capacity {args.capacity} must be a multiple of --block {args.block}, --slots >= 1")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(env=environment_line(args.commit),
                command="python benchmarks/attention_bench.py " + " ".join(sys.argv[1:] if argv is None else argv))
    rows = []
    try:
        if "decode" in args.ops:
            bench_decode(args, rows)
        if "prefill" in args.ops:
            bench_prefill(args, rows)
        if "paged" in args.ops:
            bench_paged(args, rows)
    finally:
        write(args.out, meta, rows)


if __name__ == "__main__":
    main()
