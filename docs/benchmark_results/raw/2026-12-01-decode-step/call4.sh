#!/bin/bash
# One-off (#24): the 16-row multirow window against 8 at B = 1 and 4 (K = 4, 12B), and the decode
# forward's optimized HLO with its profile (for planning the fusions).
export PYTHONPATH=$PWD
C=461ab44
for w in 8 16; do
  JAXSPEC_QMV_MULTIROW_MAX_ROWS=$w timeout 220 python benchmarks/speculative_bench.py --commit $C --target 12b --assistant 12b --runs loop --batch 1,4 --k-values 4 --max-tokens 32 --time-budget 170 --out /tmp/w$w > /tmp/w$w.log 2>&1
  echo "window $w rc=$?"; grep -v "^\s*$" /tmp/w$w.log | head -6
done
XLA_FLAGS="--xla_dump_to=/tmp/hlo" timeout 120 python benchmarks/profile_forward.py --target 12b --commit $C --out /tmp/prof > /tmp/prof.log 2>&1; echo prof rc=$?
grep -A7 "^Wall" /tmp/prof.log
ls /tmp/hlo | grep -c after_optimizations
big=$(ls -S /tmp/hlo/*after_optimizations.txt | head -3)
tar -czf $OUT/hlo.tgz $big /tmp/prof/profile.json /tmp/prof/profile.md
tar -czf $OUT/window.tgz /tmp/w8 /tmp/w16 /tmp/w8.log /tmp/w16.log --exclude='*.png'
ls -la $OUT
