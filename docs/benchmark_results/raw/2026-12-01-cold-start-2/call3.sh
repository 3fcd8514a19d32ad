#!/bin/bash
# One-off: the gpu-marked tests, then classic decode A/B repeats (now vs 9100167), alternating.
export PYTHONPATH=$PWD
timeout 270 python -m pytest -q -m gpu tests/ -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; echo gpu tests rc=$?
tail -3 $OUT/gpu-tests.log
for i in 1 2; do
  timeout 100 python benchmarks/speculative_bench.py --commit be53a21+wip2 --target 12b --no-assistant --runs loop --max-tokens 32 --out $OUT/ab-after-$i > $OUT/ab-after-$i.log 2>&1
  grep classic $OUT/ab-after-$i.log | head -1
  (cd exp/before && PYTHONPATH=$PWD timeout 100 python benchmarks/speculative_bench.py --commit 9100167 --target 12b --no-assistant --runs loop --max-tokens 32 --out $OUT/ab-before-$i > $OUT/ab-before-$i.log 2>&1)
  grep classic $OUT/ab-before-$i.log | head -1
done
rm -f $OUT/ab-*/*.png
