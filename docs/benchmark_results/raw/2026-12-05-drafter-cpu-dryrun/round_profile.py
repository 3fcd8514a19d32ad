"""Where a K = 4 round's time goes on the CPU, in the loop: one jaxspec.generate call of the real 270M
with a random 1-layer drafter (the train stage's shape) and a 32,768-token trimmed head, profiled
(jax.profiler perfetto trace), XLA ops' time summed by op name and by the dot's shapes."""
import collections, glob, gzip, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "/work/wt69/benchmarks")
import jaxspec
from jaxspec import models
from jaxspec.models import presets
from jaxspec.models.dense import prepared
from jaxspec.train import assistant as ta
vocab = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
target = models.load_target("gemma-3-270m", dtype=jnp.float32)
tcfg = target.config
key = jax.random.PRNGKey(0)
acfg = ta.assistant_config(tcfg, 1, 4096, 0, 1)
shapes = {k: v for k, v in models.assistant_shapes(acfg).items() if k != "embed_tokens"}
params = presets.random_params(shapes, jax.random.fold_in(key, 1), dtype=jnp.float32, quantize={"bits": 8})
base = prepared(models.make_assistant(acfg, dict(params, embed_tokens=target.params["embed_tokens"])).replace(matmul=target.matmul))
a = models.with_draft_vocab(base, np.arange(vocab)) if vocab else base
prompt = [2] + np.random.default_rng(0).integers(3, tcfg.vocab_size, 63).tolist()
kw = dict(max_new_tokens=24, eos_token_ids=[])
for _ in range(2):
    r = jaxspec.generate(target, prompt, assistant=a, block_size=4, **kw)
print("rounds", r.stats.rounds, "decode_s", r.stats.decode_s, "ms/round", r.stats.decode_s / r.stats.rounds * 1e3, flush=True)
d = f"/tmp/wt69/scratch/prof{vocab}"
os.system(f"rm -rf {d}")
with jax.profiler.trace(d, create_perfetto_trace=True):
    r = jaxspec.generate(target, prompt, assistant=a, block_size=4, **kw)
print("profiled: rounds", r.stats.rounds, "ms/round", r.stats.decode_s / r.stats.rounds * 1e3, flush=True)
f = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
ev = json.load(gzip.open(f[0]))["traceEvents"]
tot = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.get("ph") == "X" and "dur" in e:
        tot[e["name"]] += e["dur"]; cnt[e["name"]] += 1
for n, t in tot.most_common(45):
    print(f"{t/1e3:10.1f} ms {cnt[n]:6d}  {n[:120]}")
# the decode program's fusions: which op each is (its root's shape and kind), time per round
from jaxspec.engine import programs
import re
txt = None
for sig, c in programs._MEMO.items():
    if sig[0] == "decode":
        t = c.as_text()
        if "draft_vocab" in t or txt is None or len(t) > len(txt):
            txt = t
open(f"/tmp/wt69/scratch/decode{vocab}.hlo.txt", "w").write(txt)
dec = collections.Counter()
for e in ev:
    if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == "jit_decode":
        dec[e["name"]] += e["dur"]
tot_dec = sum(dec.values())
print(f"decode program: {tot_dec/1e3:.1f} ms over {r.stats.rounds} rounds ({tot_dec/1e3/r.stats.rounds:.1f} ms/round)")
for n, t in dec.most_common(25):
    m = re.search(r"^\s*(?:ROOT )?%?" + re.escape(n) + r" = ([^ ]+) fusion\((.*?)\), kind=.*?calls=(%?[\w.\-]+)", txt, re.M)
    desc = (m.group(1) + " <- " + m.group(2)[:150]) if m else "?"
    print(f"{t/1e3/r.stats.rounds:8.2f} ms/round  {n:24s} {desc}")
