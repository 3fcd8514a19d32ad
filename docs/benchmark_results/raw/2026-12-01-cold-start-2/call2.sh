#!/bin/bash
# One-off: decode speed and profile with the packed scan vectors, before (9100167) vs now, and cold start again.
set -x
export PYTHONPATH=$PWD
C=be53a21+wip2
timeout 200 python benchmarks/speculative_bench.py --commit $C --target 12b --assistant 12b --runs loop --k-values 4 --max-tokens 32 --time-budget 150 --out $OUT/decode-after > $OUT/decode-after.log 2>&1; echo rc=$?
head -4 $OUT/decode-after.log
(cd exp/before && PYTHONPATH=$PWD timeout 150 python benchmarks/speculative_bench.py --commit 9100167 --target 12b --no-assistant --runs loop --max-tokens 32 --out $OUT/decode-before > $OUT/decode-before.log 2>&1; echo rc=$?)
head -3 $OUT/decode-before.log
timeout 100 python benchmarks/profile_forward.py --target 12b --commit $C --out $OUT/prof-after > $OUT/prof-after.log 2>&1; echo rc=$?
grep -A8 "^Wall" $OUT/prof-after.log
rm -rf $OUT/prof-after/trace
timeout 150 python benchmarks/cold_start_bench.py --target 12b --assistant 12b --block-size 4 --disk-cache warm --commit $C --out $OUT/cold > $OUT/cold.log 2>&1; echo rc=$?
cat $OUT/cold/cold_start.md
