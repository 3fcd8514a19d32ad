"""cpu_engine_bench: one request's decode in the batch engine (what `jaxspec serve` runs) against
`jaxspec.generate` (what `jaxspec generate` runs), in one process on the real model.

    python benchmarks/cpu_engine_bench.py --configs 1,4096,4 1,32768,4 --rounds 2

Each config is `slots,capacity,rounds_per_step` (a `BatchEngine`, K = 1, warmed up first); each
round runs generate (greedy, --tokens new tokens) and then one request through each engine,
alternating, so that other processes' load falls on all. Decode tok/s counts the tokens after the
first over the time from the event that brought the first to the one that brought the last (the
engine) or `stats.decode_tokens_per_s` (generate). `--step-times`: also each engine's step wall
time and its rounds program alone (the device's share), per step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's jaxspec


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m", help="a .gguf file or a known name")
    p.add_argument("--configs", nargs="+", default=["1,4096,4"], help="slots,capacity,rounds_per_step ...")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--step-times", action="store_true")
    return p.parse_args(argv)


def engine_decode(e, ids, n: int) -> float:
    """Decode tok/s of one request of `n` tokens through engine `e` (nothing else running)."""
    e.admit(ids, n, seed=0)
    got, t1, first = 0, None, 0
    while e.live:
        for ev in e.step():
            if ev.tokens and t1 is None:
                t1, first = time.perf_counter(), len(ev.tokens)
                got = first
            elif ev.tokens:
                got += len(ev.tokens)
    e.step()
    return (got - first) / (time.perf_counter() - t1)


def step_times(e, ids) -> tuple[list[float], list[float]]:
    import jax

    e.admit(ids, min(e.max_new_tokens, 8 * e.window), seed=0)
    for _ in range(2):
        e.step()
    walls, alone = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        e.step()
        walls.append(time.perf_counter() - t0)
    # the program the engine's steps run: the row view they read (a bucket of the table on a CPU's
    # XLA path, jaxspec.engine.batching; the whole table in code without views)
    view = e.view_for([s for s, o in enumerate(e.owner) if o is not None]) if hasattr(e, "view_for") else None
    fn = e.decode(0) if view is None else e.decode(0, view)
    for _ in range(3):
        t0 = time.perf_counter()
        if view is None:
            e.state = jax.block_until_ready(fn(e.state))
        else:  # what a step runs: the cut of the state, the rounds, and their writes back into it
            e.state = jax.block_until_ready(e._rounds(0, view))
        alone.append(time.perf_counter() - t0)
    for slot, owner in enumerate(e.owner):  # its last rounds ran outside the steps: not reported
        if owner is not None:
            e.cancel(slot)
    e.step()
    return walls, alone


def main(argv=None) -> int:
    a = _args(argv)
    import jax.numpy as jnp

    import jaxspec
    from jaxspec import models
    from jaxspec.engine.batching import BatchEngine
    from jaxspec.models import gguf

    t = models.load_target(gguf.by_name(a.model) if not a.model.endswith(".gguf") else a.model, dtype=jnp.bfloat16)
    ids = [2] + list(range(1000, 1020))  # BOS and 20 ordinary ids: the same prompt on every side
    engines = {}
    for c in a.configs:
        slots, cap, rps = (int(x) for x in c.split(","))
        t0 = time.perf_counter()
        e = BatchEngine(t, None, slots=slots, max_new_tokens=cap // 2, capacity=cap, rounds_per_step=rps,
                        block_size=1, eos_token_ids=[])
        e.warm_up()
        engines[c] = e
        print(f"engine {c}: warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    jaxspec.generate(t, ids, max_new_tokens=a.tokens, eos_token_ids=[])  # compiled before the rounds
    for r in range(a.rounds):
        g = jaxspec.generate(t, ids, max_new_tokens=a.tokens, eos_token_ids=[]).stats.decode_tokens_per_s
        row = [f"generate {g:.2f}"] + [f"engine {c} {engine_decode(e, ids, a.tokens):.2f}" for c, e in engines.items()]
        views = {c: dict(getattr(e, "view_steps", {})) for c, e in engines.items()}  # steps per row view so far
        print(f"round {r + 1} (load {os.getloadavg()[0]:.1f}), decode tok/s: " + " | ".join(row)
              + (f" (steps per view: {views})" if any(views.values()) else ""), flush=True)
    if a.step_times:
        for c, e in engines.items():
            walls, alone = step_times(e, ids)
            print(f"engine {c}: step wall {[round(x, 3) for x in walls]} s, rounds program alone "
                  f"{[round(x, 3) for x in alone]} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
