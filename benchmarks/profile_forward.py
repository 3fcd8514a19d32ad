"""Where a target forward's time goes: a profiler trace of decode (or verify) forwards, summed by kernel.

    python benchmarks/profile_forward.py --target 12b [--layers 8] [--batch 1] [--width 1] --out DIR
    python benchmarks/profile_forward.py --target default --draft --out DIR    # assistant draft steps
    python benchmarks/profile_forward.py --target 12b --context 131072 --out DIR  # decode at a long context

Times `--steps` dependent forwards in one jit (as speculative_bench's forward run does), then
traces one such call with the JAX profiler and sums the device's kernel events by name and by
kind: our 4-bit matmul kernels (GEMV, tiled qmm), XLA fusions, dense matmuls, the rest. The difference
between the wall time and the summed kernel time is time the GPU sat idle between kernels (launch
gaps, host work). Writes DIR/profile.md, DIR/profile.json and the raw trace under DIR/trace/; prints
the table last. `--draft` profiles the assistant's draft steps instead (`--assistant`, default the
target's own: `default` is the shipped pair), chained and unrolled as the loop runs them, one
"forward" per step. On a machine without a GPU it reports the host's XLA executor events instead, of
the XLA matmul path (`--backend`, auto: the Pallas kernels on a GPU only; `--backend pallas` there
traces their interpreter, so only the plumbing is meaningful).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import time
from collections import defaultdict

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import devices_error, environment, median_time, no_command_buffers, split_pair  # noqa: E402
from speculative_bench import (draft_loop, forward_loop, load_pair, resolve_default_pair,  # noqa: E402
                               weight_bytes_per_token)

from jaxspec.kernels import DispatchConfig  # noqa: E402
from jaxspec.kernels.config import BACKEND_CHOICES  # noqa: E402

# Kernel-name patterns, first match wins. pallas_kernels.launch names its kernels q{bits}gemv_m*_n*
# (qmv, multirow) and q{bits}qmm_m*_n* (the tiled GEMM), with _x{count} for several weights in one
# launch. (Older saved traces name them q4mm_m16_* and q4mm[dq]_m64_*: the last two patterns.)
KINDS = [("communication (all-reduce)", ("nccl", "all-reduce", "allreduce", "all_reduce")),
         ("4-bit GEMV", ("gemv_m",)), ("4-bit tiled matmul", ("qmm_m",)),
         ("4-bit GEMV", ("mm_m16_",)), ("4-bit tiled matmul", ("mm_m", "mmdq_m")),
         ("dense matmul (XLA/cuBLAS)", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "dot")),
         ("XLA fusion", ("fusion", "loop_", "input_", "reduce", "transpose", "copy", "concatenate")),
         ("memset/memcpy", ("memset", "memcpy"))]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pats in KINDS:
        if any(p in low for p in pats):
            return kind
    return "other"


def kernel_events(trace: dict) -> tuple[list[dict], str]:
    """The complete ("X") events of one execution level of a perfetto trace, and where they came from.
    A GPU's kernels sit on its "Stream ..." threads (the "XLA Ops"/"XLA Modules" threads of the same
    device repeat them at coarser levels, so they are not added in); without a device, the host's XLA
    executor threads ("tf_XLA...")."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    devices = {p for p, n in procs.items() if n.startswith("/device:")}
    if devices:
        keep = {k for k, n in threads.items() if k[0] in devices and n.lower().startswith("stream")}
        source = "device streams"
    else:
        keep = {k for k, n in threads.items() if n.startswith("tf_XLA")}
        source = "host XLA executor threads (no device in the trace)"
    picked = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in keep
              and not e.get("name", "").startswith("ThunkExecutor")]  # the host's wait, not work
    return leaves(picked), source


def leaves(events: list[dict]) -> list[dict]:
    """The events that contain no other event of their thread (host threads nest a thunk, a while
    loop and its ops). An event is a container only if it holds the next one whole: on the H200's
    stream consecutive kernels overlap by ~0.1 us in the trace's timestamps, so a rule of "the next
    one starts before this one ends" would drop about half of them (almost every 4-bit GEMV)."""
    out = []
    by_thread = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        for i, e in enumerate(evs):
            end = float(e["ts"]) + float(e.get("dur", 0.0))
            nxt = evs[i + 1] if i + 1 < len(evs) else None
            if nxt is None or float(nxt["ts"]) + float(nxt.get("dur", 0.0)) > end:
                out.append(e)
    return out


def summarize(events: list[dict], forwards: int) -> dict:
    """Per-forward microseconds and counts by kernel name and by kind."""
    by_name = defaultdict(lambda: [0.0, 0])
    for e in events:
        by_name[e["name"]][0] += float(e.get("dur", 0.0))
        by_name[e["name"]][1] += 1
    by_kind = defaultdict(lambda: [0.0, 0])
    for name, (dur, cnt) in by_name.items():
        by_kind[kind_of(name)][0] += dur
        by_kind[kind_of(name)][1] += cnt
    per = lambda d: {k: {"us": v[0] / forwards, "count": v[1] / forwards}  # noqa: E731
                     for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])}
    return {"by_kind": per(by_kind), "by_name": per(by_name),
            "busy_us": sum(v[0] for v in by_name.values()) / forwards}


def read_trace(log_dir: str) -> dict:
    files = sorted(glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"), recursive=True))
    if not files:
        raise RuntimeError(f"the profiler wrote no perfetto trace under {log_dir}")
    with gzip.open(files[-1]) as f:
        return json.load(f)


def report(meta: dict, summary: dict, wall_us: float) -> str:
    idle = wall_us - summary["busy_us"]
    gaps = (f"idle between kernels {idle / 1e3:.3f} ms ({100 * idle / wall_us:.0f}%)"
            if meta["source"] == "device streams" else "host threads run ops concurrently, so no idle figure")
    lines = [f"# Forward profile — {meta['what']}", "",
             f"{meta['env']['device']}, JAX {meta['env']['jax']}, commit {meta['env']['commit']}, {meta['env']['date']}", "",
             f"Command: `{meta['command']}`" + (f" ({meta['note']})" if meta.get("note") else ""), "",
             f"[B, T] = [{meta['batch']}, {meta['width']}] at {meta.get('context', 64)} cached positions; "
             f"{meta['steps']} dependent forwards per call; "
             f"events from {meta['source']}; XLA command buffers (CUDA graphs) off, so every kernel "
             "is launched and traced on its own.", "",
             f"Wall per forward {wall_us / 1e3:.3f} ms (median, outside the profiler); kernels "
             f"{summary['busy_us'] / 1e3:.3f} ms; {gaps}. Weight bytes per forward {meta['weight_gb']:.4g} GB.", "",
             "| kind | ms per forward | % of wall | kernels per forward |", "|---|---|---|---|"]
    for kind, v in summary["by_kind"].items():
        lines.append(f"| {kind} | {v['us'] / 1e3:.3f} | {100 * v['us'] / wall_us:.1f} | {v['count']:.0f} |")
    lines += ["", "Top kernels:", "", "| kernel | kind | us per forward | calls per forward | us per call |",
              "|---|---|---|---|---|"]
    for name, v in list(summary["by_name"].items())[:25]:
        lines.append(f"| `{name[:80]}` | {kind_of(name)} | {v['us']:.1f} | {v['count']:.0f} | "
                     f"{v['us'] / max(v['count'], 1e-9):.1f} |")
    return "\n".join(lines) + "\n"


def write(out: str, meta: dict, wall_us: float, summary: dict) -> str:
    text = report(meta, summary, wall_us)
    with open(os.path.join(out, "profile.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "profile.json"), "w") as f:
        json.dump({"meta": meta, "wall_us": wall_us, **summary}, f, indent=1)
    return text


def resummarize(out: str) -> int:
    """Rebuild profile.md/json from a run's saved trace (after a fix to the parsing)."""
    old = json.load(open(os.path.join(out, "profile.json")))
    events, source = kernel_events(read_trace(os.path.join(out, "trace")))
    meta = dict(old["meta"], source=source,
                note="re-summarized from the saved trace with `profile_forward.py --from-trace`")
    print(write(out, meta, old["wall_us"], summarize(events, meta["steps"])))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="12b", help="preset name, checkpoint dir or `default` (the shipped pair)")
    ap.add_argument("--draft", action="store_true", help="profile assistant draft steps, not target forwards")
    ap.add_argument("--assistant", default=None, help="with --draft: checkpoint dir or preset (default: --target's)")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N target layers (preset only)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=1, help="tokens per row: 1 = decode, K = a K-wide verify")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=64, help="positions already in the cache (target forwards)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                    help="the matmul path (auto: pallas on a GPU, else xla)")
    ap.add_argument("--devices", type=int, default=1,
                    help="split the models over this process's N devices (models.shard); times are per device")
    ap.add_argument("--commit", default=None, help="the commit to name in the report (default: git rev-parse)")
    ap.add_argument("--out", default="out/profile")
    ap.add_argument("--from-trace", action="store_true",
                    help="re-summarize the trace and profile.json already in --out (no model, no GPU)")
    args = ap.parse_args(argv)
    if args.from_trace:
        return resummarize(args.out)
    if args.batch < 1 or args.width < 1 or args.steps < 1 or args.context < 1:
        ap.error("--batch, --width, --steps and --context must be >= 1")
    if args.draft and args.context != 64:
        ap.error("--context is for target forwards; --draft profiles 64 cached positions")
    if args.draft and args.width != 1:
        ap.error("--draft runs one token per row: leave --width at 1")
    bad_devices = devices_error(args.devices)
    if bad_devices:
        ap.error(bad_devices)
    args.float, args.no_assistant = False, not args.draft
    args.tokenizer = args.prompts_file = args.prompt_ids = args.prompt = None
    resolve_default_pair(args)
    if args.draft and args.assistant is None:
        args.assistant = args.target
    no_command_buffers()  # else the kernels replayed inside CUDA graphs are missing from the trace
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    # "auto" (resolve_backend): the Pallas kernels on a GPU, whose trace this tool reads; elsewhere XLA
    # (a trace of the kernels' interpreter times nothing real, and compiles slowly)
    target, assistant, what = load_pair(args, jnp.bfloat16, DispatchConfig.from_env(backend=args.backend))
    target, assistant = split_pair(target, assistant, args.devices)
    if args.devices > 1:
        what += f", split over {args.devices} devices"
    print(f"built {what} in {time.time() - t0:.1f}s", flush=True)
    if args.draft:
        if assistant is None:
            raise SystemExit(f"--draft needs an assistant: none loaded for --assistant {args.assistant!r}")
        what = f"assistant draft steps of {what}"
        run, call_args = draft_loop(assistant, target, args.batch, args.steps)
    else:
        run, call_args = forward_loop(target, args.batch, args.width, args.width, args.steps, args.context)
    wall_us = median_time(run, *call_args, warmup=1, repeats=5) / args.steps * 1e6
    log_dir = os.path.join(args.out, "trace")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(run(*call_args))
    events, source = kernel_events(read_trace(log_dir))
    summary = summarize(events, args.steps * args.devices)  # every device's streams: per device
    env = environment(args.commit)
    meta = {"what": what, "env": env, "batch": args.batch, "width": args.width, "steps": args.steps,
            "context": args.context,
            "source": source, "weight_gb": weight_bytes_per_token(assistant if args.draft else target) / 1e9,
            "command": "python benchmarks/profile_forward.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(write(args.out, meta, wall_us, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
