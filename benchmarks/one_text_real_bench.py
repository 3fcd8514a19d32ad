"""One request, one text on the REAL Gemma 3 270M on a CPU (issue 67), with its cost.

    python benchmarks/one_text_real_bench.py [--json OUT]      # this checkout's jaxspec
    cd OTHER_TREE && python /path/to/one_text_real_bench.py     # another tree's (run from its root)

In one process: greedy "The capital of France is", 32 new tokens, through `jaxspec.generate` with
the CLI's keywords (`jaxspec generate --model gemma-3-270m`: classic, block size 4), then through a
4-slot BatchEngine built as `jaxspec serve --max-batch 4` builds it (ServeConfig's rounds, block size and
prefill chunk) with a 1,024-position request capacity and a 4,096-position KV pool (the server's
own default pool is larger and only slower to compile), three other requests (greedy and sampled,
other prompts) beside it. Prints both texts, whether the tokens are equal, generate's decode tok/s
(best of 3 warm runs), the engine's tokens/s over all four requests (second drain, warm), and the
compile seconds of each (first run), and a 500-token prompt's prefill seconds (best of 2 warm
runs). bfloat16, all cores."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the tree this is run from (its jaxspec), else this checkout's
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = "The capital of France is"
OTHERS = [("Once upon a time", 0.0), ("The best way to learn a language is", 0.8), ("def fibonacci(n):", 0.7)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    import jax
    import jaxspec
    from jaxspec import models
    from jaxspec.engine import sampling
    from jaxspec.engine.batching import BatchEngine
    from jaxspec.models import gguf
    from jaxspec.serve.config import ServeConfig
    from jaxspec.text import load_tokenizer

    path = gguf.source("gemma-3-270m")
    target = models.load_target(path)
    jax.block_until_ready(target)
    tok = load_tokenizer(path)
    ids, n = tok.encode(PROMPT), args.tokens
    eos = tuple(tok.eos_token_ids)
    out = {"tree": os.getcwd(), "jaxspec": jaxspec.__file__}

    t0 = time.perf_counter()
    r = jaxspec.generate(target, [ids], params=sampling.SamplingParams(max_new_tokens=n), block_size=4,
                         eos_token_ids=eos, verify_pad=None, drafter=None)
    out["generate_first_s"] = time.perf_counter() - t0
    rates = []
    for _ in range(3):
        r = jaxspec.generate(target, [ids], params=sampling.SamplingParams(max_new_tokens=n), block_size=4,
                             eos_token_ids=eos, verify_pad=None, drafter=None)
        rates.append((r.stats.new_tokens - 1) / r.stats.decode_s)
    out["generate_tok_s"] = max(rates)
    out["cli_tokens"] = r.tokens[0]
    out["cli_text"] = tok.decode(r.tokens[0])

    long_ids = (ids + tok.encode(" " + " ".join(t for t, _ in OTHERS)) * 40)[:500]  # a 500-token prompt's prefill
    pre = []
    for _ in range(3):
        rl = jaxspec.generate(target, [long_ids], params=sampling.SamplingParams(max_new_tokens=2), block_size=4,
                              eos_token_ids=(), verify_pad=None, drafter=None)
        pre.append(rl.stats.prefill_s)
    out["prefill_500_s"] = min(pre[1:])

    c = ServeConfig()
    engine = BatchEngine(target, None, slots=4, max_new_tokens=64, capacity=1024, block_size=c.block_size,
                         eos_token_ids=eos, rounds_per_step=c.rounds_per_chunk, kv_blocks=4096 // 16, block_tokens=16,
                         prefill_chunk=c.prefill_chunk)
    t0 = time.perf_counter()
    engine.warm_up()
    out["engine_compile_s"] = time.perf_counter() - t0
    for rep in range(2):
        where, got = {}, {}
        reqs = [(ids, sampling.SamplingParams(max_new_tokens=n))] + [
            (tok.encode(text), sampling.SamplingParams(max_new_tokens=n, temperature=temp, seed=7 + i))
            for i, (text, temp) in enumerate(OTHERS)]
        t0, total = time.perf_counter(), 0
        for i, (rid, params) in enumerate(reqs):
            where[engine.admit(rid, n, params=params, owner=i)] = i
            got[i] = []
        while engine.live:
            for ev in engine.step():
                got[where[ev.slot]] += ev.tokens
                total += len(ev.tokens)
        out[f"engine_tok_s_{rep}"] = total / (time.perf_counter() - t0)
    out["server_tokens"] = got[0]
    out["server_text"] = tok.decode(got[0])
    out["equal"] = got[0] == out["cli_tokens"]
    first = next((i for i, (a, b) in enumerate(zip(got[0], out["cli_tokens"])) if a != b), None)
    out["first_difference"] = first
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
