"""CPU decode on the REAL Gemma 3 270M (its GGUF), side by side in one run, and the default pair's demo A/B.

    nice -n -10 python benchmarks/cpu_decode_real_bench.py --out docs/benchmark_results/cpu-decode-real-270m-2026-12-03.md

Part 1, one process: jaxspec classic decoding (`models.load_target("gemma-3-270m")`: the GGUF's exact
load, its weights prepared dense once at load on a CPU, bfloat16 by default) against transformers
eager attention in float32 reading the same GGUF (`AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...)`, dequantized to float32). Same prompt ids (the GGUF's tokenizer, BOS first), greedy,
`--tokens` new tokens; only decoding is timed: tokens/s = (tokens - 1) / the time of the steps
after the prefill's token, on both sides. Each side runs once untimed first (warm: compiled, caches
touched), then they alternate (A/B/A/B) so that other processes' load falls on both. All cores
(XLA's default; torch's default thread count, printed). The resident memory of the jaxspec side is
reported twice: the weights' bytes (`models.weight_bytes`) and the process's RSS after its load and
warm-up, measured before transformers is imported.

Part 2, `--demo-rounds N` (default 2): the default pair's `make demo` command,
`python -m jaxspec generate "def is_prime(n):" --max-tokens 64 --compare`, run alternately from
`--base-tree` (default: commit `--base` unpacked from this repository with `git archive`, the
quantized XLA path before issue 53) and this tree, one process each, after one untimed run of each
(which fills the persistent compile cache, as a second `make demo` finds it). The table reports
the stats line's speculative and classic decode tok/s and the command's wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
sys.path[:0] = [TREE, HERE]  # this checkout's jaxspec, not an installed one
from cpu_decode_bench import hf_decode, run_header  # noqa: E402  (the same decode loop and labels)

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden screw press into a system that could")
DEMO = ["generate", "def is_prime(n):", "--max-tokens", "64", "--compare"]
STATS = re.compile(r"decode ([\d.]+) tok/s.*classic ([\d.]+) tok/s.*identical to classic: (\w+)")


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m", help="a .gguf file or a known name (default gemma-3-270m)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="jaxspec's activation dtype")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per run (the first comes from the prefill)")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds after the warm-up run of each side")
    p.add_argument("--demo-rounds", type=int, default=2, help="default-pair demo A/B rounds (0: skip)")
    p.add_argument("--base", default="50117c1", help="the commit whose tree is the demo's 'before'")
    p.add_argument("--base-tree", help="a checkout to run as 'before' instead of unpacking --base")
    p.add_argument("--out", help="write the results as markdown here")
    return p.parse_args()


def _rss_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, MiB."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                got[k] = int(v.split()[0]) / 1024
    return got["VmRSS"], got["VmHWM"]


def jax_side(model: str, dtype: str, tokens: int):
    import jax
    import jax.numpy as jnp

    import jaxspec
    from jaxspec import models
    from jaxspec.text import load_tokenizer
    from jaxspec.models import gguf

    path = gguf.source(model) or model  # the .gguf file (transformers reads the same one)
    rss0 = _rss_mib()[0]
    t0 = time.perf_counter()
    target = models.load_target(path, dtype=getattr(jnp, dtype))
    jax.block_until_ready(target)
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(path)
    prompt = tok.encode(PROMPT)

    def decode():
        r = jaxspec.generate(target, [prompt], max_new_tokens=tokens, eos_token_ids=[])
        s = r.stats
        return dict(tok_s=(s.new_tokens - 1) / s.decode_s, decode_s=s.decode_s, prefill_s=s.prefill_s,
                    tokens=r.tokens[0], backend=s.backend)

    t0 = time.perf_counter()
    first = decode()  # warm-up: compiles
    warm_s = time.perf_counter() - t0
    rss, hwm = _rss_mib()
    info = dict(path=path, load_s=load_s, warmup_s=warm_s, weight_bytes=models.weight_bytes(target),
                dense=target.matmul.dense_weights, backend=first["backend"], rss_before_mib=rss0,
                rss_mib=rss, hwm_mib=hwm, prompt_tokens=len(prompt), text=tok.decode(first["tokens"]))
    return decode, prompt, info


def hf_side(path: str):
    import torch
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    return model, time.perf_counter() - t0


def _unpack(commit: str) -> str:
    """The tree of `commit` in a temporary directory (git archive: no worktree, no repository change)."""
    out = tempfile.mkdtemp(prefix=f"jaxspec-{commit}-")
    archive = subprocess.run(["git", "-C", TREE, "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return out


def demo_once(tree: str) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "jaxspec", *DEMO], cwd=tree, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": tree})
    wall = time.perf_counter() - t0
    m = STATS.search(p.stdout + p.stderr)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"the demo in {tree} failed (rc {p.returncode}): {(p.stdout + p.stderr)[-800:]}")
    return dict(spec=float(m.group(1)), classic=float(m.group(2)), identical=m.group(3), wall_s=wall)


def main() -> int:
    args = _args()
    if args.tokens < 2:
        raise SystemExit("--tokens must be >= 2 (the first token comes from the prefill)")
    started = time.time()
    load_start = os.getloadavg()
    jdecode, prompt, jinfo = jax_side(args.model, args.dtype, args.tokens)
    print(f"jaxspec: loaded in {jinfo['load_s']:.1f} s, weights {jinfo['weight_bytes'] / 2**20:.0f} MiB, "
          f"RSS {jinfo['rss_mib']:.0f} MiB; text: {jinfo['text']!r}", flush=True)
    model, hf_load_s = hf_side(jinfo["path"])
    hf_first = hf_decode(model, prompt, args.tokens)  # warm-up
    runs = {"jaxspec": [], "transformers": []}
    for r in range(args.rounds):
        runs["jaxspec"].append(jdecode())
        runs["transformers"].append(hf_decode(model, prompt, args.tokens))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['tok_s']:.2f} tok/s" for k, v in runs.items()), flush=True)
    med = {k: sorted(x["tok_s"] for x in v)[len(v) // 2] for k, v in runs.items()}
    same = next((i for i, (a, b) in enumerate(zip(runs["jaxspec"][0]["tokens"], hf_first["tokens"])) if a != b),
                min(len(runs["jaxspec"][0]["tokens"]), len(hf_first["tokens"])))
    del model
    print(json.dumps(dict(runs={k: [x["tok_s"] for x in v] for k, v in runs.items()}, jax_info=jinfo)), flush=True)
    demo, demo_error = [], None
    if args.demo_rounds:
        base = args.base_tree or _unpack(args.base)
        sides = [("before", base), ("after", TREE)]
        try:
            for _, tree in sides:  # untimed: fills the compile cache, as a second `make demo` finds it
                demo_once(tree)
            for r in range(args.demo_rounds):
                for name, tree in sides:
                    demo.append(dict(round=r + 1, tree=name, **demo_once(tree)))
                    print(f"demo round {r + 1} {name}: {demo[-1]}", flush=True)
        except RuntimeError as e:  # part 1's results are still written
            demo_error = str(e)
    res = dict(**run_header(TREE), nice=os.nice(0), loadavg_start=load_start,
               loadavg_end=os.getloadavg(), minutes=(time.time() - started) / 60, jax_info=jinfo,
               hf_load_s=hf_load_s, runs={k: [x["tok_s"] for x in v] for k, v in runs.items()}, median=med,
               ratio=med["jaxspec"] / med["transformers"], same_prefix=same, demo=demo, demo_error=demo_error, base=args.base_tree or args.base)
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            f.write(_markdown(res, args))
    return 0


def _markdown(res: dict, args) -> str:
    j, med, runs = res["jax_info"], res["median"], res["runs"]
    la = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
    lines = [
        f"# CPU decode on the real Gemma 3 270M: jaxspec classic vs transformers eager float32 ({res['date']})", "",
        f"- CPU: {res['cpu']}; JAX {res['jax']}, torch {res['torch']} ({res['torch_threads']} threads); "
        f"process niceness {res['nice']}",
        f"- commit: {res['commit']}{' (with uncommitted changes)' if res['dirty'] else ''}",
        f"- command: `{res['command']}` ({res['minutes']:.0f} minutes in all)",
        f"- load average at the start {la(res['loadavg_start'])}, at the end {la(res['loadavg_end'])}: this 2-core "
        "machine is shared with other processes; the sides alternate (A/B/A/B) so that both see their load",
        f"- model: {os.path.basename(j['path'])} (the GGUF's exact load). jaxspec: `models.load_target`, "
        f"{args.dtype}, matmul backend {j['backend']}, weights prepared dense at load: {j['dense']}; "
        "transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`, float32, eager attention",
        f"- prompt: {j['prompt_tokens']} tokens (the GGUF's tokenizer, BOS first), greedy, {args.tokens} new tokens; "
        f"tokens/s = {args.tokens - 1} decode steps / their time (prefill and its token excluded), warm",
        f"- greedy tokens: jaxspec's and transformers' agree on the first {res['same_prefix']} of {args.tokens}",
        "",
        "| round | jaxspec tok/s | transformers tok/s |", "|---|---|---|"]
    for i in range(len(runs["jaxspec"])):
        lines.append(f"| {i + 1} | {runs['jaxspec'][i]:.2f} | {runs['transformers'][i]:.2f} |")
    lines += [f"| median | {med['jaxspec']:.2f} | {med['transformers']:.2f} |", "",
              f"**jaxspec / transformers = {res['ratio']:.2f}x** (medians)", "",
              "## Resident memory, jaxspec side", "",
              f"- weights as held (`models.weight_bytes`): {j['weight_bytes']:,} bytes "
              f"({j['weight_bytes'] / 2**20:.0f} MiB)",
              f"- process RSS: {j['rss_before_mib']:.0f} MiB before the load (Python, JAX), {j['rss_mib']:.0f} MiB "
              f"after the load and the warm-up run (peak {j['hwm_mib']:.0f} MiB), before transformers was imported",
              f"- load {j['load_s']:.1f} s, warm-up run (compiles) {j['warmup_s']:.1f} s; transformers' load "
              f"{res['hf_load_s']:.1f} s",
              f"- jaxspec's greedy text: {j['text']!r}", "",
              "Where a CPU step goes before and after the dense weights (the 270M shape, random weights): "
              "[cpu-decode-2026-12-03.md](cpu-decode-2026-12-03.md) (`benchmarks/cpu_decode_bench.py --breakdown-only`)."]
    if res["demo_error"]:
        lines += ["", f"The default pair's demo A/B stopped: {res['demo_error']}"]
    if res["demo"]:
        lines += ["", "## The default pair: `make demo` (`python -m jaxspec " + " ".join(
            f'"{a}"' if " " in a else a for a in DEMO) + "`)", "",
            f"Alternating \"before\" ({res['base']}: the quantized XLA path) and \"after\" (this tree), one process "
            "each, after one untimed run of each.", "",
            "| round | tree | speculative K=4 tok/s | classic tok/s | identical to classic | wall s |",
            "|---|---|---|---|---|---|"]
        lines += [f"| {d['round']} | {d['tree']} | {d['spec']:.1f} | {d['classic']:.1f} | {d['identical']} | "
                  f"{d['wall_s']:.1f} |" for d in res["demo"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
