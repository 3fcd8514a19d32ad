"""Streaming against generate on the 12B (classic, random weights): per-token time and identical tokens."""
import json, os, sys, time
sys.path.insert(0, "benchmarks")
import numpy as np
import jaxspec
from jaxspec import streaming
from harness import random_pair
from pallas_kernels import DispatchConfig

OUT = os.environ["OUT"]
t, _ = random_pair(os.environ.get("TARGET", "12b"), None, matmul=DispatchConfig.from_env(backend=os.environ.get("BACKEND", "pallas")))
ids = np.random.default_rng(0).integers(2, min(1000, t.config.vocab_size), 32).tolist()
kw = dict(max_new_tokens=128, block_size=1, eos_token_ids=())
res = {}
for _ in range(2):
    g = jaxspec.generate(t, [ids], **kw)
res["generate_decode_tok_s"] = g.stats.decode_tokens_per_s
for rpc in (1, 4):
    for _ in range(2):
        t0 = time.perf_counter(); chunks = list(streaming.stream_generate(t, [ids], rounds_per_chunk=rpc, **kw))
        wall = time.perf_counter() - t0
    toks = sum((c.tokens[0] for c in chunks), [])
    st = chunks[-1].result.stats
    res[f"stream_{rpc}"] = dict(identical=toks == g.tokens[0], decode_tok_s=st.decode_tokens_per_s, wall_s=wall,
                                chunks=len(chunks), rounds=st.rounds)
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(OUT, "stream_probe.json"), "w"), indent=1)

# the previous streaming loop (the decode loop per chunk, read back after each call), for comparison
import jax
from jaxspec.generate import plan
p = plan(t, [ids], **kw)
pre = p.gen.compiled_prefill(t, *p.inputs)
for _ in range(2):
    state = jax.block_until_ready(pre())
    dec = p.gen.compiled_decode(t, None, state)
    t0 = time.perf_counter(); n = 1
    while n < 128:
        state = dec(state, 1)
        out, n_out, done, rounds = jax.device_get((state.out, state.n_out, state.done, state.rounds))
        n = int(n_out[0])
    old = time.perf_counter() - t0
res["previous_loop_1_round_chunks"] = dict(tok_s=127 / old, identical=out[0, :128].tolist() == g.tokens[0])
print(res["previous_loop_1_round_chunks"])
json.dump(res, open(os.path.join(OUT, "stream_probe.json"), "w"), indent=1)
