"""What reading a 4-bit weight's bytes costs on this GPU through the libraries (run under ncu).

The qmv target (docs/kernels.md) is a fraction of a bytes floor taken at the copy bandwidth of a
multi-GB buffer. A 33 MB weight is read in ~10 us, where ramp-up and tail are a large share, so
this measures what the best-tuned code we did not write achieves on the same byte count: XLA's
reduction over the packed words (and over words + scales + biases), an elementwise pass, and a bf16
GEMV whose matrix has exactly the 4-bit weight's bytes (through PyTorch, i.e. cuBLAS; through XLA
too, but XLA autotunes a dot's first compile, ~1000 kernels under ncu, and the process crashed at
its end on the H200: pass --rows '' there). `--dense`: PyTorch's bf16 GEMM of the weight's own
shape, the reference of the qmm target. The `ceiling` step of run_h200_bench.sh runs all three:

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \\
        python benchmarks/read_ceiling.py --lib torch --shapes 15360x3840,262144x3840 --rows 1,8

Inputs are made on the host (numpy) so the only kernels in the process are the measured ones; each
op runs once, after a compile-and-run warm-up call (ncu profiles both: read the second). ncu flushes
the caches before every kernel it profiles, so each read comes from DRAM.
"""
from __future__ import annotations

import argparse

import numpy as np

GROUP = 64


def arrays(n: int, k: int, seed: int = 0):
    """Random packed words [N, K/8] uint32 and bf16-sized scales/biases [2, N, K/g] (as uint16 bits),
    and the number of bf16 rows of K whose bytes equal the whole 4-bit weight."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    sb = rng.integers(0, 2**14, size=(2, n, k // GROUP), dtype=np.uint16)  # finite bf16 bit patterns
    nbytes = words.nbytes + sb.nbytes
    return words, sb, nbytes // (2 * k)


def run_jax(shapes, rows):
    import jax
    import jax.numpy as jnp
    for n, k in shapes:
        words, sb, eq_rows = arrays(n, k)
        w, s = jax.device_put(words), jax.device_put(sb)
        dense = jax.device_put(np.random.default_rng(1).standard_normal((eq_rows, k), dtype=np.float32).astype(jnp.bfloat16))
        ops = {
            "xla sum(words)": (jax.jit(lambda w: jnp.sum(w, dtype=jnp.uint32)), (w,)),
            "xla sum(words)+sum(sb)": (jax.jit(lambda w, s: jnp.sum(w, dtype=jnp.uint32)
                                               + jnp.sum(s, dtype=jnp.uint32)), (w, s)),
            "xla copy(words)": (jax.jit(lambda w: w ^ jnp.uint32(0x5A5A5A5A)), (w,)),
        }
        for r in rows:
            x = jax.device_put(np.random.default_rng(2 + r).standard_normal((r, k)).astype(jnp.bfloat16))
            ops[f"xla bf16 dot [{r}, {k}] x [{eq_rows}, {k}]^T"] = (
                jax.jit(lambda x, d: jnp.dot(x, d.T, preferred_element_type=jnp.float32).astype(x.dtype)), (x, dense))
        for name, (f, args) in ops.items():
            for i in range(2):  # compile + warm-up, then the one to read
                jax.block_until_ready(f(*args))
                print(f"ran {name} {n}x{k} call{i}", flush=True)


def run_torch(shapes, rows, dense_rows=False):
    import torch
    for n, k in shapes:
        words, sb, eq_rows = arrays(n, k)
        eq_rows = n if dense_rows else eq_rows
        w = torch.from_numpy(words.view(np.int32)).cuda()
        dense = torch.from_numpy(np.random.default_rng(1).standard_normal((eq_rows, k), dtype=np.float32)).cuda()
        dense = dense.to(torch.bfloat16)  # one conversion kernel, before the measured ones
        dst = torch.empty_like(w)
        ops = {"torch sum(words)": lambda: w.sum(dtype=torch.int64), "torch copy(words)": lambda: dst.copy_(w)}
        for r in rows:
            x = torch.randn(r, k, device="cuda").to(torch.bfloat16)
            ops[f"torch bf16 mm [{r}, {k}] x [{eq_rows}, {k}]^T"] = (lambda x=x: x @ dense.T)
        for name, f in ops.items():
            for i in range(2):
                f()
                torch.cuda.synchronize()
                print(f"ran {name} {n}x{k} call{i}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", choices=("jax", "torch"), default="jax")
    p.add_argument("--shapes", default="15360x3840")
    p.add_argument("--rows", default="1,8", help="activation rows for the bf16 GEMV of equal bytes ('' for none)")
    p.add_argument("--dense", action="store_true", help="torch: the bf16 GEMM of the weight's own [N, K] "
                   "(the qmm target's reference) instead of one of equal bytes")
    a = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    rows = [int(r) for r in a.rows.split(",") if r]
    if a.dense:
        if a.lib != "torch":
            p.error("--dense runs the torch library's GEMM")
        run_torch(shapes, rows, dense_rows=True)
    else:
        (run_jax if a.lib == "jax" else run_torch)(shapes, rows)


if __name__ == "__main__":
    main()
