#!/bin/bash
# One-off: the new default (16-row window, bucket <= 8) at B = 1 and 4, K = 4, on the 12B; and whether
# a GPU executable served by JAX's persistent cache re-serializes whole (CPU's does not).
export PYTHONPATH=$PWD
C=a9a596e
timeout 230 python benchmarks/speculative_bench.py --commit $C --target 12b --assistant 12b --runs loop --batch 1,4 --k-values 4 --max-tokens 32 --time-budget 180 --out /tmp/new > /tmp/new.log 2>&1
echo "bench rc=$?"; grep -v "^\s*$" /tmp/new.log | head -7
cat > /tmp/reser.py <<'PY'
import sys, json, jax
from jax.experimental import serialize_executable as se
from jaxspec import compile_cache
from models import presets
import jaxspec
compile_cache.enable("/tmp/jc")
t, a = presets.tiny_pair(6)
from jaxspec import programs
with compile_cache.CompileLog() as log:
    out = jaxspec.generate(t, [[5, 6, 7, 8, 9]], assistant=a, max_new_tokens=6, block_size=4)
if sys.argv[1] == "save":  # re-serialize what this process holds (JAX-cache-served) and reload it
    for sig, c in list(programs._MEMO.items()):
        blob = se.serialize(c)
        programs._MEMO[sig] = se.deserialize_and_load(*blob)
    out2 = jaxspec.generate(t, [[5, 6, 7, 8, 9]], assistant=a, max_new_tokens=6, block_size=4)
    print("reloaded tokens equal:", out2.tokens == out.tokens)
print(json.dumps(dict(hits=log.cache_hits, loaded=log.loaded, tokens=out.tokens)))
PY
rm -rf /tmp/jc
timeout 60 python /tmp/reser.py plain 2>&1 | tail -1
rm -rf /tmp/jc/jaxspec-programs
timeout 60 python /tmp/reser.py save 2>&1 | tail -3
tar -czf $OUT/new.tgz --exclude='*.png' /tmp/new /tmp/new.log 2>/dev/null; ls $OUT
