"""Where a batch engine step's time goes: decode steps of every slot, and a step that also admits.

    python benchmarks/serve_step_profile.py --target 12b --slots 32 --rounds-per-step 4 --out DIR

Builds `BatchEngine` as serve_bench's engine rows do (random 4-bit weights, `--capacity` positions a
slot), fills every slot with a `--prompt-len`-token request whose budget outlasts the run, and once
every slot decodes (no prompt left to prefill):
- decode: `--steps` steps timed back to back (the engine's own pipelining, the device drained before
  and after), then one traced step;
- admit: `--admit` slots cancelled and re-admitted with fresh prompts, and the step that prefills
  them, timed and traced (repeated `--admit-repeats` times for the time).
The traces are summed by kernel and by part: 4-bit matmuls, attention kernels, the pool's gather
(a paged cache's row view), cache writes (scatter / dynamic-update-slice), other XLA fusions. The
busy time against the wall time is what the host and launch gaps cost. Runs on older trees too (it
finds BatchEngine and DispatchConfig where they were), so one command compares two commits: copy this
file into the older tree's benchmarks/ and run it there. Writes DIR/step_profile.json and .md.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import environment, random_pair  # noqa: E402
from profile_forward import kernel_events, kind_of, read_trace  # noqa: E402

try:
    from jaxspec.engine.batching import BatchEngine
    from jaxspec.kernels import DispatchConfig
except ImportError:  # trees before jaxspec's rooms
    from jaxspec.batching import BatchEngine
    from pallas_kernels import DispatchConfig

PARTS = [("attention kernels", ("attention",)), ("pool gather", ("gather",)),
         ("cache writes", ("scatter", "dynamic-update-slice", "dynamic_update_slice"))]


def part_of(name: str) -> str:
    low = name.lower()
    for part, pats in PARTS:
        if any(p in low for p in pats):
            return part
    return kind_of(name)


def traced(fn) -> tuple[float, dict]:
    """(wall ms of fn(), per-part and per-kernel device ms) of one traced call of `fn`."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t0 = time.perf_counter()
            fn()
            wall = (time.perf_counter() - t0) * 1e3
        events, _ = kernel_events(read_trace(d))
    parts, names = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in events:
        ms = float(e.get("dur", 0.0)) / 1e3
        parts[part_of(e["name"])] += ms
        names[e["name"]][0] += ms
        names[e["name"]][1] += 1
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:25]
    return wall, {"busy_ms": sum(parts.values()), "parts": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
                  "top_kernels": [{"name": n, "ms": v[0], "count": v[1]} for n, v in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="12b")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--rounds-per-step", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="engines that take one (default: theirs)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--admit", type=int, default=2, help="slots re-admitted for the admit step")
    ap.add_argument("--admit-repeats", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    target, _ = random_pair(args.target, None, matmul=DispatchConfig.from_env(backend="auto"))
    kw = dict(slots=args.slots, max_new_tokens=args.capacity - args.prompt_len - 16, capacity=args.capacity,
              block_size=1, eos_token_ids=(), rounds_per_step=args.rounds_per_step)
    if args.prefill_chunk and "prefill_chunk" in inspect.signature(BatchEngine).parameters:
        kw["prefill_chunk"] = args.prefill_chunk
    engine = BatchEngine(target, None, **kw)
    rng = np.random.default_rng(0)
    prompt = lambda: rng.integers(2, target.config.vocab_size, args.prompt_len).tolist()  # noqa: E731
    budget = args.rounds_per_step * (args.steps + 4 * args.admit_repeats + 8) + 16
    slots = [engine.admit(prompt(), budget, seed=0) for _ in range(args.slots)]
    for _ in range(args.slots * args.prompt_len // 16 + 4):  # every prompt prefilled, then the pipeline full
        engine.step()
        if not getattr(engine, "prefilling", None):
            break
    for _ in range(3):
        engine.step()
    jax.block_until_ready(engine.state)

    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    jax.block_until_ready(engine.state)
    decode_ms = (time.perf_counter() - t0) * 1e3 / args.steps

    def one_step():
        engine.step()
        jax.block_until_ready(engine.state)
    decode_wall, decode_trace = traced(one_step)

    def admit_step():
        for s in slots[:args.admit]:
            engine.cancel(s)
        for i in range(args.admit):
            slots[i] = engine.admit(prompt(), budget, seed=i)
        one_step()
        while getattr(engine, "prefilling", None):  # a chunk budget below the prompts: their other steps
            one_step()
    admit_ms = []
    for _ in range(args.admit_repeats):
        t0 = time.perf_counter()
        admit_step()
        admit_ms.append((time.perf_counter() - t0) * 1e3)
    admit_wall, admit_trace = traced(admit_step)

    tokens = args.slots * args.rounds_per_step
    row = {"label": args.label, "env": environment(args.commit), "args": vars(args), "engine": kw,
           "decode_step_ms": decode_ms, "decode_tok_s": tokens / decode_ms * 1e3,
           "decode_traced_wall_ms": decode_wall, "decode": decode_trace,
           "admit_step_ms_median": float(np.median(admit_ms)), "admit_traced_wall_ms": admit_wall, "admit": admit_trace}
    with open(os.path.join(args.out, "step_profile.json"), "w") as f:
        json.dump(row, f, indent=1)
    lines = [f"# step profile {args.label} — {args.target}, {args.slots} slots x {args.rounds_per_step} rounds, "
             f"capacity {args.capacity}", "",
             f"decode step {decode_ms:.2f} ms ({row['decode_tok_s']:.0f} tok/s); admit step (+{args.admit} "
             f"prefills) {row['admit_step_ms_median']:.2f} ms", "",
             "| part | decode step ms | admit step ms |", "|---|---|---|"]
    for part in sorted(set(decode_trace["parts"]) | set(admit_trace["parts"]),
                       key=lambda p: -decode_trace["parts"].get(p, 0.0)):
        lines.append(f"| {part} | {decode_trace['parts'].get(part, 0.0):.2f} | {admit_trace['parts'].get(part, 0.0):.2f} |")
    lines.append(f"| busy / traced wall | {decode_trace['busy_ms']:.2f} / {decode_wall:.2f} | "
                 f"{admit_trace['busy_ms']:.2f} / {admit_wall:.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "step_profile.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
