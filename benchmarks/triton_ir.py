"""Inspect what Triton makes of our kernel, without a GPU.

    python benchmarks/triton_ir.py --shape 15360,3840 --rows 1 [--set groups_per_step=2 ...] --out DIR

Lowers one GEMV/qmm launch as the dispatch would shape it (`--kernel fma` for the CUDA-core GEMV,
`mma` for the tensor-core kernel) for CUDA (JAX builds the Triton IR on any machine), writes
DIR/kernel.ttir, and, when the `triton` package is importable (`pip install triton==3.6.0`, the
version the H200 machine has; it needs no GPU), compiles it for sm_90 and writes kernel.ttgir,
kernel.ptx and kernel.sass, then prints the facts that decided kernel changes so far: registers per
thread (ptxas), shared memory, which loads of the main loop Triton pipelined (async copies) and
which it left as plain loads that every iteration waits for (docs/kernels.md, log entry 3), and the
SASS instructions of the main loop per weight a thread handles (log entry 4).

A proxy, not the code that runs: on the H200, jaxlib 0.11.2 hands the Triton IR to XLA, which
compiles it with the Triton it bundles, and the results differ (the fma GEMV's one-row launch: 168
registers here, 64 in Nsight Compute there; log entry 5). For the device's own registers and
executed instructions use the `ncu` step of benchmarks/run_h200_bench.sh.

Uses JAX internals (the Pallas Triton lowering); a developer tool, not part of the library.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from collections import Counter  # noqa: E402

from pallas_kernels import DispatchConfig, QuantizedWeight  # noqa: E402
from pallas_kernels.dispatch import launcher  # noqa: E402
from pallas_kernels.kernel import Tiling, launch_many  # noqa: E402
from pallas_kernels.tiling import gemv_tiling, qmm_tiling  # noqa: E402


def _lower_capturing(module, attr: str, keep, n: int, k: int, rows: int, tiling, group_size: int,
                     many=None, **lower_kwargs) -> list:
    """Lower one launch (abstract bf16 x, 4-bit weight; or with `many`, a tuple of Ns, one
    kernel.launch_many over weights of those Ns) with `module.attr` wrapped so that `keep(result)`
    of each of its calls is collected; the wrapper is removed afterwards."""
    captured = []
    original = getattr(module, attr)

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(keep(result))
        return result

    def weight(n):  # scales/biases [K/g, N], the layout models store ("kn")
        return QuantizedWeight(jax.ShapeDtypeStruct((n, k // 8), jnp.uint32),
                               jax.ShapeDtypeStruct((k // group_size, n), jnp.bfloat16),
                               jax.ShapeDtypeStruct((k // group_size, n), jnp.bfloat16), 4, group_size, "kn")

    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    if many:
        qw, run = tuple(weight(m) for m in many), launch_many
    else:
        qw, run = weight(n), launcher(tiling)
    setattr(module, attr, capture)
    try:
        jax.jit(lambda x, w: run(x, w, tiling, interpret=False)).trace(x, qw).lower(**lower_kwargs)
    finally:
        setattr(module, attr, original)
    return captured


def lower_to_ttir(n: int, k: int, rows: int, tiling, group_size: int = 64, many=None) -> str:
    """The Triton IR (text, no debug locations) of one launch, lowered for CUDA on this machine."""
    from jax._src.pallas.triton import pallas_call_registration as reg
    captured = _lower_capturing(reg.lowering, "lower_jaxpr_to_triton_module",
                                lambda r: r.module.operation.get_asm(enable_debug_info=False),
                                n, k, rows, tiling, group_size, many, lowering_platforms=("cuda",))
    if len(captured) != 1:
        raise RuntimeError(f"expected one Triton module, lowered {len(captured)}")
    return captured[0]


def main_loop(ttgir: str) -> str:
    """The body of the first scf.for (the K loop) in a TTGIR listing."""
    start = ttgir.find("scf.for")
    if start < 0:
        return ""
    depth, i = 0, ttgir.index("{", start)
    for j in range(i, len(ttgir)):
        depth += {"{": 1, "}": -1}.get(ttgir[j], 0)
        if depth == 0:
            return ttgir[i:j]
    return ttgir[i:]


def sass_loop_ops(sass: str) -> Counter:
    """Opcode counts of the longest backward-branch range (the main loop) of a cuobjdump listing."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in ins
             if (m := re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)) and int(m.group(1), 16) < a]
    if not loops:
        return Counter()
    lo, hi = max(loops, key=lambda p: p[1] - p[0])
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins if lo <= a <= hi)


def weights_per_thread_step(tiling, group_size: int = 64) -> int:
    return tiling.block_n * tiling.groups_per_step * group_size // (32 * tiling.num_warps)


def compile_and_report(ttir_path: str, tiling, out: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    kernel = triton.compile(ttir_path, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=tiling.num_warps, num_stages=tiling.num_stages))
    with open(os.path.join(out, "kernel.ttgir"), "w") as f:
        f.write(kernel.asm["ttgir"])
    loop = main_loop(kernel.asm["ttgir"])
    plain = re.findall(r"(%\w+) = tt\.load ", loop)
    yields = " ".join(re.findall(r"scf\.yield ([^:]*)", loop))
    carried = [v for v in plain if re.search(re.escape(v) + r"\b", yields)]
    report = {"shared_bytes": kernel.metadata.shared,
              "loop_async_copies": loop.count("async_copy_global_to_local"),
              "loop_plain_loads_waited_for": len(plain) - len(carried),
              "loop_plain_loads_prefetched": len(carried)}
    with open(os.path.join(out, "kernel.ptx"), "w") as f:
        f.write(kernel.asm["ptx"])
    report.update(ptx_report(os.path.join(out, "kernel.ptx"), tiling, out))
    return report


def _nvidia_tool(name: str) -> str | None:
    """ptxas / cuobjdump from pip triton's bundle, else from PATH."""
    if importlib.util.find_spec("triton") is not None:
        import triton
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        if os.path.exists(path):
            return path
    return shutil.which(name)


def ptx_report(ptx_path: str, tiling, out: str) -> dict:
    """Registers (ptxas -v) and the main loop's SASS instructions per weight a thread handles, for a
    PTX file compiled for sm_90a (needs ptxas; the SASS part needs cuobjdump)."""
    report = {}
    ptxas, cuobjdump = _nvidia_tool("ptxas"), _nvidia_tool("cuobjdump")
    if ptxas is None:
        return report
    cubin = os.path.join(out, "kernel.cubin")
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", cubin], capture_output=True, text=True)
    m = re.search(r"Used (\d+) registers", r.stdout + r.stderr)
    report["registers"] = int(m.group(1)) if m else None
    if cuobjdump is not None and os.path.exists(cubin):
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
        with open(os.path.join(out, "kernel.sass"), "w") as f:
            f.write(sass)
        ops = sass_loop_ops(sass)
        report["loop_instructions_per_weight"] = round(sum(ops.values()) / weights_per_thread_step(tiling), 2)
        report["loop_ops"] = dict(ops.most_common(10))
        # the MMA operand's trip through shared memory (log entry 7): stores, loads, barriers
        report["loop_shared_ops"] = {op: ops.get(op, 0) for op in ("STS", "LDS", "LDSM", "BAR")}
    return report


def _value(v: str):
    return {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="15360,3840", help="N,K of the 4-bit g64 weight")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--kernel", choices=("fma", "mma"), default=None,
                    help="the GEMV kernel for rows <= 8 (default: the dispatch's, $JAXSPEC_GEMV_KERNEL)")
    ap.add_argument("--set", action="append", default=[], help="Tiling field=value over the dispatch's choice")
    ap.add_argument("--many", default=None,
                    help="N1,N2,...: one launch over weights of these Ns (kernel.launch_many), K from --shape")
    ap.add_argument("--out", default="out/triton_ir")
    args = ap.parse_args(argv)
    n, k = (int(v) for v in args.shape.split(","))
    many = tuple(int(v) for v in args.many.split(",")) if args.many else None
    if many:
        n = sum(many)  # the dispatch tiles a fused launch by the summed N
    cfg = DispatchConfig() if args.kernel is None else DispatchConfig(gemv_kernel=args.kernel)
    tiling = gemv_tiling((n, k), 64, cfg) if args.rows <= cfg.multirow_max_rows else qmm_tiling(args.rows, (n, k), 64, cfg)
    tiling = dataclasses.replace(tiling, **{f: _value(v) for f, v in (s.split("=", 1) for s in args.set)})
    if many and not isinstance(tiling, Tiling):
        ap.error("--many needs the tensor-core kernel (kernel.launch_many); the fma GEMV has no fused launch")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "kernel.ttir")
    with open(path, "w") as f:
        f.write(lower_to_ttir(n, k, args.rows, tiling, many=many))
    print(tiling)
    print(f"wrote {path}")
    if importlib.util.find_spec("triton") is None:
        print("triton is not installed: `pip install triton==3.6.0` to compile for sm_90 here")
        return 0
    print(compile_and_report(path, tiling, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
