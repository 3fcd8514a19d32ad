"""CPU decode, side by side: jaxspec classic decoding against transformers eager (float32), one run.

    python benchmarks/cpu_decode_bench.py --out docs/benchmark_results/cpu-decode-2026-12-03.md
    python benchmarks/cpu_decode_bench.py --breakdown-only --tree /work/main    # another tree's jaxspec

Both sides run a Gemma-3-270M-shaped model (18 layers, width 640, FFN 2048, 4 query heads and 1 KV
head of 256, sliding window 512 on 5 of every 6 layers, tied 262,144 x 640 embedding) with random
weights: jaxspec's 4-bit (group 64) bfloat16 model from `presets.random_model` on
`DispatchConfig(backend="xla", dense=True)` (prepared dense, as the CPU's loaders do), and
transformers' `Gemma3ForCausalLM` of the same shape in float32 with eager attention. Same prompt
(random ids after BOS), greedy, 64 new tokens; only decoding is timed (the prompt's prefill and its
first token excluded: tokens/s = 63 / time of the 63 steps on both sides), warm (each side runs once first), all cores. The sides alternate (A/B/A/B) so that load
from other processes falls on both.

`--breakdown-only` times where one jaxspec decode step goes instead: the whole step forward, the
head's matmul, the 18 attention calls, the greedy pick; "layers" is the step less those. `--tree`
imports jaxspec from another checkout (to compare an older tree on this machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Gemma 3 270M's shape (its GGUF's metadata, /work/shared/reference section 12)
SHAPE = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
             num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
             max_position_embeddings=32768, rms_norm_eps=1e-6)
PATTERN = ["sliding_attention"] * 5 + ["full_attention"]


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="new tokens per run (the first comes from the prefill)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds after the warm-up run of each side")
    p.add_argument("--out", help="write the results as markdown here")
    p.add_argument("--tree", default=os.path.dirname(HERE), help="the jaxspec checkout to import")
    p.add_argument("--breakdown-only", action="store_true", help="time the pieces of one jaxspec step")
    p.add_argument("--no-transformers", action="store_true")
    return p.parse_args()


def _prompt(n: int):
    import numpy as np
    return [2] + np.random.default_rng(0).integers(3, SHAPE["vocab_size"], n - 1).tolist()


def jax_target(tree: str):
    sys.path.insert(0, tree)
    import jax
    import jax.numpy as jnp
    from jaxspec import models
    from jaxspec.kernels import DispatchConfig
    layers = PATTERN * (SHAPE["num_hidden_layers"] // len(PATTERN))
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    d = models.presets.tiny_target_dict(
        **{k: v for k, v in SHAPE.items()}, global_head_dim=SHAPE["head_dim"], num_global_key_value_heads=1,
        layer_types=layers, rope_parameters=rope, final_logit_softcapping=None)
    cfg = models.TargetConfig.from_dict(d)
    t0 = time.perf_counter()
    # dense=True: the presets keep quantized weights unless asked (a tree from before issue 53 has no such field)
    dense = {"dense": True} if "dense" in DispatchConfig.__dataclass_fields__ else {}
    target = models.presets.random_model(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16,
                                         matmul=DispatchConfig(backend="xla", **dense))
    jax.block_until_ready(target)
    load_s = time.perf_counter() - t0
    wb = models.weight_bytes(target) if hasattr(models, "weight_bytes") else sum(
        int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(target.params))
    return target, load_s, wb


def jax_decode(target, prompt, tokens: int) -> dict:
    import jaxspec
    r = jaxspec.generate(target, [prompt], max_new_tokens=tokens, eos_token_ids=[])
    s = r.stats
    steps = s.new_tokens - 1
    return dict(tok_s=steps / s.decode_s, decode_s=s.decode_s, steps=steps, prefill_s=s.prefill_s,
                tokens=r.tokens[0])


def hf_model():
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    layers = PATTERN * (SHAPE["num_hidden_layers"] // len(PATTERN))
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = Gemma3TextConfig(**SHAPE, layer_types=layers, rope_parameters=rope, hidden_activation="gelu_pytorch_tanh",
                           tie_word_embeddings=True, query_pre_attn_scalar=256, final_logit_softcapping=None)
    cfg._attn_implementation = "eager"
    t0 = time.perf_counter()
    model = Gemma3ForCausalLM(cfg).float().eval()
    return model, time.perf_counter() - t0


def hf_decode(model, prompt, tokens: int) -> dict:
    """Greedy, the KV cache carried: the prefill (and its token) untimed, then `tokens - 1` steps."""
    import torch
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model(input_ids=ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        got = [int(nxt)]
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            got.append(int(nxt))
        dt = time.perf_counter() - t0
    return dict(tok_s=(tokens - 1) / dt, decode_s=dt, steps=tokens - 1, tokens=got)


def breakdown(target, prompt_len: int, tokens: int, reps: int = 5) -> dict:
    """ms of one decode step's pieces (median of `reps`), at the step's own row count."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxspec import models
    from jaxspec.kernels import quantized_matmul
    from jaxspec.models.layers import attention
    from jaxspec.models.target import head_weight
    cfg, mm = target.config, target.matmul
    rows = models.row_bucket(target, 1)
    cap = prompt_len + tokens + 16
    cache = models.init_cache(cfg, 1, cap, target.dtype)
    ids = jnp.asarray([_prompt(prompt_len)], jnp.int32)
    _, _, cache = jax.jit(models.forward)(target, ids, cache)
    tok = jnp.asarray([[5]], jnp.int32)
    h = jnp.asarray(np.random.default_rng(1).standard_normal((1, rows, cfg.hidden_size)), target.dtype)
    hd, nq = cfg.head_dim, cfg.num_attention_heads
    q = jnp.asarray(np.random.default_rng(2).standard_normal((1, rows, nq, hd)), target.dtype)
    kv = jnp.asarray(np.random.default_rng(3).standard_normal((1, cap, 1, hd)), target.dtype)
    pos = jnp.full((1, rows), prompt_len, jnp.int32)
    kpos = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32)[None], (1, cap))

    def attn18(q, k, v):
        out = 0
        for i in range(cfg.num_hidden_layers):  # what the step's 18 attention calls compute
            win = cfg.sliding_window if cfg.is_sliding(i) else None
            out = out + attention(q, k * (i + 1), v, pos, kpos, win, matmul=mm, rows=1)
        return out

    logits = jnp.asarray(np.random.default_rng(4).standard_normal((1, 1, cfg.vocab_size)), jnp.float32)
    pieces = {
        "step (forward, 1 token)": (jax.jit(lambda t, x, c: models.forward(t, x, c)[0]), (target, tok, cache)),
        "head matmul": (jax.jit(lambda t, x: quantized_matmul(x, head_weight(t), config=t.matmul)), (target, h)),
        "attention x18": (jax.jit(attn18), (q, kv, kv)),
        "greedy pick (argmax)": (jax.jit(lambda x: jnp.argmax(x, -1)), (logits,)),
    }
    out = {}
    for name, (f, a) in pieces.items():
        jax.block_until_ready(f(*a))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts.append(time.perf_counter() - t0)
        out[name] = 1e3 * sorted(ts)[len(ts) // 2]
    out["layers (step - head - attention)"] = (out["step (forward, 1 token)"] - out["head matmul"]
                                               - out["attention x18"])
    out["rows per step"] = rows
    return out


def run_header(tree: str) -> dict:
    """What a result file records about the run: date, CPU, versions, the tree's commit (and whether it
    had uncommitted changes), the exact command, torch's thread count."""
    import jax
    import torch

    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), cpu=_cpu(),
                jax=jax.__version__, torch=torch.__version__, commit=_git(tree, "rev-parse", "--short", "HEAD"),
                dirty=bool(_git(tree, "status", "--porcelain", "--untracked-files=no")),
                command="python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                torch_threads=torch.get_num_threads())


def _git(tree: str, *args) -> str:
    try:
        return subprocess.run(["git", "-C", tree, *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        return f"{names[0]} x {len(names)} logical CPUs" if names else platform.processor()
    except OSError:
        return platform.processor()


def main() -> int:
    args = _args()
    if args.tokens < 2:
        raise SystemExit("--tokens must be >= 2 (the first token comes from the prefill)")
    prompt = _prompt(args.prompt_len)
    target, load_s, wbytes = jax_target(args.tree)
    if args.breakdown_only:
        print(json.dumps(dict(tree=args.tree, commit=_git(args.tree, "rev-parse", "--short", "HEAD"),
                              weight_bytes=wbytes, breakdown=breakdown(target, args.prompt_len, args.tokens))))
        return 0
    runs = {"jaxspec": [], "transformers": []}
    first = jax_decode(target, prompt, args.tokens)  # warm-up: compiles
    model = None
    if not args.no_transformers:
        model, hf_load_s = hf_model()
        hf_decode(model, prompt, args.tokens)  # warm-up
    for r in range(args.rounds):
        runs["jaxspec"].append(jax_decode(target, prompt, args.tokens))
        if model is not None:
            runs["transformers"].append(hf_decode(model, prompt, args.tokens))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]['tok_s']:.2f} tok/s" for k, v in runs.items() if v),
              flush=True)
    bd = breakdown(target, args.prompt_len, args.tokens)
    med = {k: sorted(x["tok_s"] for x in v)[len(v) // 2] for k, v in runs.items() if v}
    ratio = med["jaxspec"] / med["transformers"] if "transformers" in med else None
    load = os.getloadavg()
    res = dict(**run_header(args.tree), loadavg=load, weight_bytes=wbytes, jax_load_s=load_s,
               runs={k: [x["tok_s"] for x in v] for k, v in runs.items()}, median=med, ratio=ratio, breakdown=bd,
               jax_prefill_s=first["prefill_s"])
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            f.write(_markdown(res, args))
    return 0


def _markdown(res: dict, args) -> str:
    med, runs = res["median"], res["runs"]
    lines = [
        f"# CPU decode: jaxspec classic vs transformers eager float32, Gemma-3-270M shape ({res['date']})", "",
        f"- CPU: {res['cpu']}; JAX {res['jax']}, torch {res['torch']} ({res['torch_threads']} threads)",
        f"- commit: {res['commit']}{' (with uncommitted changes)' if res['dirty'] else ''}",
        f"- command: `{res['command']}`",
        f"- load average at the end: {', '.join(f'{x:.1f}' for x in res['loadavg'])}: other processes were "
        "running on this shared 2-core machine; the sides alternate (A/B/A/B) so that both see it",
        f"- model: random weights, Gemma-3-270M shape; jaxspec 4-bit g64 bfloat16 on DispatchConfig(backend='xla'), "
        f"resident weight bytes {res['weight_bytes'] / 2**20:.0f} MiB (models.weight_bytes); transformers "
        "Gemma3ForCausalLM float32, eager attention",
        f"- {args.tokens} new tokens, prompt {args.prompt_len} tokens, greedy; tokens/s = {args.tokens - 1} decode "
        "steps / their time (prefill and its token excluded), warm", "",
        "| round | jaxspec tok/s | transformers tok/s |", "|---|---|---|"]
    for i in range(len(runs["jaxspec"])):
        t = runs["transformers"][i] if i < len(runs["transformers"]) else float("nan")
        lines.append(f"| {i + 1} | {runs['jaxspec'][i]:.2f} | {t:.2f} |")
    if res["ratio"] is not None:
        lines.append(f"| median | {med['jaxspec']:.2f} | {med['transformers']:.2f} |")
        lines += ["", f"**jaxspec / transformers = {res['ratio']:.2f}x** (medians)"]
    lines += ["", "## Where a jaxspec step goes (ms, median of 5, this tree)", "", "| piece | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in res["breakdown"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
