#!/bin/bash
# One-off (#24, second session): q in decode_attention's row layout. gpu tests; classic decode now
# (B = 1 and 8) against 5873375 (attention_inputs only) and 2da13d6, alternating; K = 4 at B = 1, 4; a profile.
export PYTHONPATH=$PWD
C=5873375+q-rows
timeout 100 python -m pytest -q -m gpu tests/test_attention_inputs.py tests/test_decode_attention.py -p no:cacheprovider > /tmp/gpu-tests.log 2>&1; echo gpu tests rc=$?; tail -2 /tmp/gpu-tests.log
bench() { timeout 100 python benchmarks/speculative_bench.py --target 12b --no-assistant --runs loop --max-tokens 32 "$@"; }
for i in 1 2; do
  bench --commit $C --batch 1,8 --out /tmp/now-$i > /tmp/now-$i.log 2>&1; echo now rc=$?; grep "classic B" /tmp/now-$i.log
  (cd exp/mid && PYTHONPATH=$PWD bench --commit 5873375 --out /tmp/mid-$i > /tmp/mid-$i.log 2>&1; echo mid rc=$?); grep "classic B" /tmp/mid-$i.log
done
(cd exp/before && PYTHONPATH=$PWD bench --commit 2da13d6 --batch 1,8 --out /tmp/before > /tmp/before.log 2>&1; echo before rc=$?); grep "classic B" /tmp/before.log
timeout 150 python benchmarks/speculative_bench.py --commit $C --target 12b --assistant 12b --runs loop --batch 1,4 --k-values 4 --max-tokens 32 --out /tmp/k4 > /tmp/k4.log 2>&1; echo k4 rc=$?; grep "^| spec\|^| classic" /tmp/k4/*.md | head
timeout 100 python benchmarks/profile_forward.py --target 12b --commit $C --out /tmp/prof > /tmp/prof.log 2>&1; echo prof rc=$?; grep -A6 "^| kind" /tmp/prof.log
rm -rf /tmp/prof/trace
tar -czf $OUT/call2.tgz --exclude='*.png' /tmp/gpu-tests.log /tmp/now-* /tmp/mid-* /tmp/before* /tmp/k4* /tmp/prof* 2>/dev/null; ls -la $OUT
