"""Device spike: the current flash_attention against flash_variants.flash_attention_v at the 12B's
global-layer shape (B = 1, causal, no window, D = 512, Hq = 16, Hkv = 1 from models.presets, bf16).

    OUT=/some/dir PYTHONPATH=<repo>:<repo>/.probe python .probe/flash_bench.py        # H200, ~4 min
    OUT=/tmp/x    PYTHONPATH=<repo>:<repo>/.probe python .probe/flash_bench.py --smoke  # CPU, interpret

Per config, in order (CONFIGS, most promising first): compile at T = 8192 (inside a try: a compile
failure, e.g. shared memory overflow, is recorded and the sweep goes on); compare its output with
the current kernel's at T = 8192 (max abs / relative L2 difference, and both against a float64
reference on the last 16 rows); time T = 8192 and T = 32768 (2 warm-ups, median of 10, each run
jax.block_until_ready); TFLOP/s = 4 * B * Hq * T^2 / 2 * D / time. A config under 0.6x the
baseline at 8K skips 32K; past the time budget the rest are skipped (recorded).
The configs run in a child process: if it dies (a Triton abort, a segfault), that config is
recorded as crashed and a fresh child continues with the next. JSON lines: $OUT/flash.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name, kernel ("base": pallas_kernels.flash_attention, "v": flash_attention_v), tiling.
# smem estimate (KB, D = 512, bf16): Q rows*1 + stages * block_k * (1 + 1/d_split); rows = ht * bq.
# acc registers per thread (MMAv3, warps along rows, 16 rows a warp): 512 / d_split / 2.
CONFIGS = [
    dict(name="base_default", kernel="base", block_q=32, block_k=32, num_warps=4, num_stages=2),
    dict(name="v_s1_h1_q32_k32_w4_n2", kernel="v", d_split=1, heads_together=1, block_q=32, block_k=32, num_warps=4, num_stages=2),
    dict(name="v_s2_h1_q128_k32_w8_n1", kernel="v", d_split=2, heads_together=1, block_q=128, block_k=32, num_warps=8, num_stages=1),
    dict(name="v_s2_h2_q64_k32_w8_n1", kernel="v", d_split=2, heads_together=2, block_q=64, block_k=32, num_warps=8, num_stages=1),
    dict(name="v_s2_h2_q64_k32_w8_n2", kernel="v", d_split=2, heads_together=2, block_q=64, block_k=32, num_warps=8, num_stages=2),
    dict(name="v_s2_h2_q64_k64_w8_n1", kernel="v", d_split=2, heads_together=2, block_q=64, block_k=64, num_warps=8, num_stages=1),
    dict(name="v_s2_h1_q128_k64_w8_n1", kernel="v", d_split=2, heads_together=1, block_q=128, block_k=64, num_warps=8, num_stages=1),
    dict(name="v_s2_h1_q64_k32_w4_n2", kernel="v", d_split=2, heads_together=1, block_q=64, block_k=32, num_warps=4, num_stages=2),
    dict(name="v_s2_h2_q32_k32_w4_n2", kernel="v", d_split=2, heads_together=2, block_q=32, block_k=32, num_warps=4, num_stages=2),
    dict(name="v_s2_h1_q64_k32_w4_n3", kernel="v", d_split=2, heads_together=1, block_q=64, block_k=32, num_warps=4, num_stages=3),
    dict(name="v_s2_h1_q64_k64_w4_n1", kernel="v", d_split=2, heads_together=1, block_q=64, block_k=64, num_warps=4, num_stages=1),
    dict(name="v_s2_h4_q16_k32_w4_n3", kernel="v", d_split=2, heads_together=4, block_q=16, block_k=32, num_warps=4, num_stages=3),
    dict(name="v_s4_h2_q64_k32_w8_n2", kernel="v", d_split=4, heads_together=2, block_q=64, block_k=32, num_warps=8, num_stages=2),
    dict(name="v_s4_h2_q64_k64_w8_n1", kernel="v", d_split=4, heads_together=2, block_q=64, block_k=64, num_warps=8, num_stages=1),
    dict(name="v_s4_h1_q64_k64_w4_n2", kernel="v", d_split=4, heads_together=1, block_q=64, block_k=64, num_warps=4, num_stages=2),
    dict(name="v_s4_h1_q64_k32_w4_n3", kernel="v", d_split=4, heads_together=1, block_q=64, block_k=32, num_warps=4, num_stages=3),
    dict(name="v_s1_h2_q32_k32_w4_n2", kernel="v", d_split=1, heads_together=2, block_q=32, block_k=32, num_warps=4, num_stages=2),
    dict(name="v_s1_h2_q16_k64_w4_n1", kernel="v", d_split=1, heads_together=2, block_q=16, block_k=64, num_warps=4, num_stages=1),
]


def smem_kb(cfg, d=512):
    ds, rows = cfg.get("d_split", 1), cfg.get("heads_together", 1) * cfg["block_q"]
    return (rows * d * 2 + cfg["num_stages"] * cfg["block_k"] * (d + d // ds) * 2) / 1024


# ------------------------------------------------------------------ worker (runs the configs)
def worker(args):
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from flash_variants import flash_attention_v
    from models.presets import TARGETS
    from pallas_kernels.flash_attention import flash_attention

    p = TARGETS["12b"]
    hq, hkv, d = p["num_attention_heads"], p["num_global_key_value_heads"], p["global_head_dim"]
    b = 1
    interpret = args.smoke
    t_check, t_big = (64, 128) if args.smoke else (8192, 32768)
    repeats, warmup = (2, 1) if args.smoke else (10, 2)
    out_path = os.path.join(args.out, "flash.jsonl")
    progress = os.path.join(args.out, "flash.progress")
    deadline = args.t0 + args.budget

    def inputs(t, seed):
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        # q scaled by D^-1/2: scores ~ N(0, 1) (scale 1.0 in the kernel), a softmax that averages
        # many keys, so accumulation differences show; k, v ~ N(0, 1)
        q = (jax.random.normal(kq, (b, t, hq, d), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
        k = jax.random.normal(kk, (b, t, hkv, d), jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (b, t, hkv, d), jnp.float32).astype(jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        return q, k, v, pos, pos

    def fn_of(cfg):
        kw = {k_: v_ for k_, v_ in cfg.items() if k_ not in ("name", "kernel")}
        f = flash_attention if cfg["kernel"] == "base" else flash_attention_v
        return jax.jit(functools.partial(f, interpret=interpret, **kw))

    def timed(fn, args_):
        for _ in range(warmup):
            jax.block_until_ready(fn(*args_))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args_))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)), float(np.min(ts))

    def tflops(t, sec):
        return 4 * b * hq * t * t / 2 * d / sec / 1e12

    if args.start == 0:
        print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, Hq={hq} Hkv={hkv} D={d}, "
              f"T={t_check}/{t_big}, interpret={interpret}", flush=True)
    x8 = inputs(t_check, 1)
    xbig = None
    # reference for the check: the current kernel at its defaults, and float64 on the last 16 rows
    base_out = np.asarray(jnp.asarray(fn_of(CONFIGS[0])(*x8), jnp.float32))
    q, k, v, pos, _ = x8
    last = 16
    qf, kf, vf = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q[:, -last:], k, v))
    s = np.einsum("bthd,bcd->bhtc", qf, kf[:, :, 0])
    s = s - s.max(-1, keepdims=True)  # causal: the last rows see all keys but the future ones
    tq = np.arange(t_check - last, t_check)[:, None]
    s = np.where(np.arange(t_check)[None, :] <= tq, s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    ref_last = np.einsum("bhtc,bcd->bthd", pr / pr.sum(-1, keepdims=True), vf[:, :, 0])

    def rel(a, ref):
        return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))

    base_ref_err = rel(base_out[:, -last:].astype(np.float64), ref_last)
    base_tf = None
    for i in range(args.start, len(CONFIGS)):
        cfg = CONFIGS[i]
        with open(progress, "w") as f:
            f.write(str(i))
        rec = dict(i=i, **cfg, smem_kb_est=round(smem_kb(cfg), 1), t_check=t_check, t_big=t_big)
        if os.environ.get("FLASH_BENCH_CRASH_AT") == str(i):  # test hook: the parent's recovery
            os._exit(3)
        if time.time() > deadline:
            rec.update(status="skipped: time budget")
            _emit(out_path, rec)
            continue
        fn = fn_of(cfg)
        try:
            t0 = time.perf_counter()
            compiled = fn.lower(*x8).compile()
            rec["compile_s"] = round(time.perf_counter() - t0, 2)
            out = np.asarray(jnp.asarray(compiled(*x8), jnp.float32))
        except Exception as e:  # noqa: BLE001 - any compile/run failure is a result
            rec.update(status="compile/run failed", error=f"{type(e).__name__}: {str(e)[:600]}")
            _emit(out_path, rec)
            continue
        diff = np.abs(out - base_out)
        rec.update(max_abs_diff=float(diff.max()), rel_l2_vs_base=rel(out, base_out),
                   max_abs_base=float(np.abs(base_out).max()), nan=bool(np.isnan(out).any()),
                   rel_vs_f64_last16=rel(out[:, -last:].astype(np.float64), ref_last),
                   base_rel_vs_f64_last16=base_ref_err)
        ok = not rec["nan"] and rec["rel_l2_vs_base"] < 1e-2 and rec["rel_vs_f64_last16"] < 2 * base_ref_err + 2e-3
        rec["check"] = "ok" if ok else "MISMATCH"
        try:
            med, mn = timed(compiled, x8)
            rec.update(ms_8k=med * 1e3, ms_8k_min=mn * 1e3, tflops_8k=tflops(t_check, med))
            if base_tf is None and cfg["kernel"] == "base":
                base_tf = rec["tflops_8k"]
            slow = base_tf is not None and rec["tflops_8k"] < 0.6 * base_tf
            if slow and not args.smoke:
                rec["big"] = "skipped: < 0.6x baseline at 8K"
            elif time.time() > deadline - 20:
                rec["big"] = "skipped: time budget"
            else:
                if xbig is None:
                    xbig = inputs(t_big, 2)
                t0 = time.perf_counter()
                compiled_big = fn.lower(*xbig).compile()
                rec["compile_big_s"] = round(time.perf_counter() - t0, 2)
                med, mn = timed(compiled_big, xbig)
                rec.update(ms_big=med * 1e3, ms_big_min=mn * 1e3, tflops_big=tflops(t_big, med))
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001
            rec.update(status="timing failed", error=f"{type(e).__name__}: {str(e)[:600]}")
        _emit(out_path, rec)
    with open(progress, "w") as f:
        f.write(str(len(CONFIGS)))


def _emit(path, rec):
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    short = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
             if k not in ("kernel", "d_split", "heads_together", "block_q", "block_k", "num_warps", "num_stages")}
    print(json.dumps(short), flush=True)


# ------------------------------------------------------------------ parent (restarts, table)
def table(path):
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    rows = [r for r in rows if "name" in r]
    base = next((r.get("tflops_8k") for r in rows if r.get("kernel") == "base" and "tflops_8k" in r), None)
    base_big = next((r.get("tflops_big") for r in rows if r.get("kernel") == "base" and "tflops_big" in r), None)
    hdr = (f"{'config':28s} {'ds':>2s} {'ht':>2s} {'bq':>3s} {'bk':>3s} {'w':>2s} {'st':>2s} {'smemKB':>6s} "
           f"{'maxdiff':>8s} {'rel':>8s} {'chk':>5s} {'TF@8K':>6s} {'x':>5s} {'TF@32K':>6s} {'x':>5s}  status")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        def f(key, fmt):
            w = int(fmt.split(".")[0])
            return format(r[key], fmt) if isinstance(r.get(key), (int, float)) else "-".rjust(w)
        x8 = f"{r['tflops_8k'] / base:.2f}" if base and "tflops_8k" in r else "-"
        xb = f"{r['tflops_big'] / base_big:.2f}" if base_big and "tflops_big" in r else "-"
        status = r.get("status", "?") + (f" ({r['big']})" if "big" in r else "")
        if "error" in r:
            status += " | " + r["error"].replace("\n", " ")[:110]
        print(f"{r['name']:28s} {r.get('d_split', 1):>2d} {r.get('heads_together', 1):>2d} {r['block_q']:>3d} "
              f"{r['block_k']:>3d} {r['num_warps']:>2d} {r['num_stages']:>2d} {r['smem_kb_est']:>6.0f} "
              f"{f('max_abs_diff', '8.1e')} {f('rel_l2_vs_base', '8.1e')} {r.get('check', '-'):>5s} "
              f"{f('tflops_8k', '6.1f')} {x8:>5s} {f('tflops_big', '6.1f')} {xb:>5s}  {status}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny T, interpret=True (CPU check of the script)")
    ap.add_argument("--budget", type=float, default=210.0, help="seconds for the whole sweep (configs past it skipped)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    os.makedirs(args.out, exist_ok=True)
    path, progress = os.path.join(args.out, "flash.jsonl"), os.path.join(args.out, "flash.progress")
    for p in (path, progress):
        if os.path.exists(p):
            os.remove(p)
    t0, start = time.time(), 0
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    while start < len(CONFIGS):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--start", str(start), "--t0", str(t0),
               "--budget", str(args.budget), "--out", args.out] + (["--smoke"] if args.smoke else [])
        if os.path.exists(progress):
            os.remove(progress)
        rc = subprocess.call(cmd, env=env)
        if not os.path.exists(progress):  # died before its first config (setup, the baseline check)
            print(f"worker failed during setup (rc {rc}); stopping", flush=True)
            break
        done = int(open(progress).read())
        if done >= len(CONFIGS):
            break
        cfg = CONFIGS[done]
        _emit(path, dict(i=done, **cfg, smem_kb_est=round(smem_kb(cfg), 1), status=f"crashed (worker rc {rc})"))
        start = done + 1
    if os.path.exists(progress):
        os.remove(progress)
    print(f"\nT = 8192 / 32768 (smoke: 64 / 128), B = 1, causal, D = 512, bf16; {time.time() - t0:.0f} s in all\n")
    table(path)


if __name__ == "__main__":
    main()
