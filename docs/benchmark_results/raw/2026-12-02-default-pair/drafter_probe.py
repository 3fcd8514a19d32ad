"""Draft-step and verify time on this device: the shipped assistant vs variants (random 4-bit
weights, same target): fewer layers, narrower. Prints JSON lines."""
import dataclasses, json, sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import models
from models.presets import random_model
from jaxspec.default_pair import load_default_pair
from jaxspec.default_pair import train as T
from speculative_bench import draft_time, forward_time
import jaxspec

out = sys.argv[1]
tgt, ast, tok = load_default_pair(jnp.bfloat16)
def emit(r):
    print(json.dumps(r), flush=True)
    open(out, "a").write(json.dumps(r) + "\n")

emit(dict(what="target forward T=1", ms=forward_time(tgt, 1, 1, 1) * 1e3))
emit(dict(what="target verify T=4", ms=forward_time(tgt, 1, 4, 4) * 1e3))
emit(dict(what="shipped assistant draft step", ms=draft_time(ast, tgt, 1) * 1e3))
for name, kw in [("a_layers=1", dict(a_layers=1)), ("a_layers=2 (random)", {}),
                 ("a_layers=1 a_ffn=768", dict(a_layers=1, a_ffn=768)),
                 ("a_layers=2 a_hidden=256 a_ffn=768 a_heads=4", dict(a_hidden=256, a_ffn=768, a_heads=4))]:
    s = dataclasses.replace(T.FULL_SIZES, **kw)
    acfg = T.assistant_config(s)
    a = random_model(acfg, jax.random.key(3))
    emit(dict(what=name, ms=draft_time(a, tgt, 1) * 1e3))
# the whole loop, shipped pair, held-out prompts: classic vs K=4 (decode seconds)
from jaxspec.default_pair import heldout_prompts
rows = [p["ids"] for p in heldout_prompts()][:10]
for k in (1, 4):
    jaxspec.generate(tgt, rows[0], assistant=ast if k > 1 else None, block_size=k, max_new_tokens=64, eos_token_ids=[1])
    tot = 0.0; rr = 0; new = 0
    for r in rows:
        res = jaxspec.generate(tgt, r, assistant=ast if k > 1 else None, block_size=k, max_new_tokens=64, eos_token_ids=[1])
        tot += res.stats.decode_s; rr += res.stats.row_rounds; new += len(res.tokens[0])
    emit(dict(what=f"generate K={k}", decode_s=tot, rounds=rr, new=new, ms_per_round=tot / rr * 1e3))
