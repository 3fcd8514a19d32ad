"""Engine against generate, bit for bit, at XLA's default optimisation level (issue 67's -O question).

    python benchmarks/engine_bits_bench.py --model gemma-3-270m [--dtype float32]
    python benchmarks/engine_bits_bench.py --model default --dtype float32

The tests compile at -O0 (tests/conftest.py), where the batch engine's log-probabilities are
`jaxspec.generate`'s bit for bit; this checks what a user runs. One process, no XLA_FLAGS of its own
(pass XLA_FLAGS to try others, e.g. --xla_cpu_max_isa=AVX): `jaxspec.generate` with the CLI's keywords
(classic), then a BatchEngine built as `jaxspec serve` builds it (ServeConfig's rounds a step and
prefill chunk) at each --slots, one greedy and one seeded request (T = 0.8) of --tokens tokens, each
alone. Prints, per engine and request: whether the tokens are equal, and at how many positions the
token's log-probability differs, and by how much. bfloat16 agreed everywhere on 2026-12-05; the
default pair's target in float32 did not (docs/benchmark_results/first-impression-cpu-2026-12-05.md)."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = {"gemma-3-270m": "The capital of France is", "default": "def is_prime(n):"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(PROMPTS), default="gemma-3-270m")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--slots", default="1,4")
    p.add_argument("--tokens", type=int, default=32)
    a = p.parse_args()
    import jax.numpy as jnp
    import numpy as np

    import jaxspec
    from jaxspec import models
    from jaxspec.engine import sampling
    from jaxspec.engine.batching import BatchEngine
    from jaxspec.serve.config import ServeConfig

    dtype = getattr(jnp, a.dtype)
    if a.model == "default":
        from jaxspec.default_pair import load_default_pair
        target, _, tok = load_default_pair(dtype)
        ids, eos, capacity, kv = tok.encode(PROMPTS[a.model]).ids, (), 256, None
    else:
        from jaxspec.models import gguf
        from jaxspec.text import load_tokenizer
        path = gguf.source(a.model)
        target, tok = models.load_target(path, dtype=dtype), load_tokenizer(path)
        ids, eos, capacity, kv = tok.encode(PROMPTS[a.model]), tuple(tok.eos_token_ids), 1024, 4096 // 16
    n = a.tokens
    requests = {"greedy": sampling.SamplingParams(max_new_tokens=n, logprobs=0),
                "seeded": sampling.SamplingParams(max_new_tokens=n, temperature=0.8, seed=42, logprobs=0)}
    want = {}
    for name, params in requests.items():
        r = jaxspec.generate(target, [ids], params=params, block_size=4, eos_token_ids=eos, drafter=None)
        want[name] = (r.tokens[0], np.array([lp for lp, _ in r.logprobs[0]]))
    c = ServeConfig()
    print(f"{a.model}, {a.dtype}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for slots in (int(s) for s in a.slots.split(",")):
        engine = BatchEngine(target, None, slots=slots, max_new_tokens=64, capacity=capacity, block_size=1,
                             eos_token_ids=eos, rounds_per_step=c.rounds_per_chunk, block_tokens=16,
                             prefill_chunk=c.prefill_chunk, **({} if kv is None else {"kv_blocks": kv}))
        for name, params in requests.items():
            engine.admit(ids, n, params=params)
            tokens, lps = [], []
            while engine.live:
                for ev in engine.step():
                    tokens += ev.tokens
                    lps += [lp for lp, _ in ev.logprobs or []]
            m = min(len(lps), len(want[name][1]))
            d = np.abs(np.array(lps[:m]) - want[name][1][:m])
            print(f"{slots} slot(s), {name}: tokens equal {tokens == want[name][0]}, log-probabilities differ at "
                  f"{int((d > 0).sum())}/{m} positions (at most {d.max():.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
