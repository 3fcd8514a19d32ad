#!/bin/bash
# One-off: cold start of the 12B with programs.compile_all + the program store, and decode profiles before/after the layer scan.
set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import jax; print(jax.__version__, jax.devices())"
C=$(git rev-parse --short HEAD 2>/dev/null || echo wip)
timeout 260 python benchmarks/cold_start_bench.py --target 12b --assistant 12b --block-size 4 --disk-cache warm --commit "$C+wip" --out $OUT/cold > $OUT/cold.log 2>&1; echo cold rc=$?
tail -5 $OUT/cold.log
timeout 120 python benchmarks/profile_forward.py --target 12b --commit "$C+wip" --out $OUT/prof-after > $OUT/prof-after.log 2>&1; echo prof-after rc=$?
tail -30 $OUT/prof-after.log
(cd exp/before && PYTHONPATH=$PWD timeout 120 python benchmarks/profile_forward.py --target 12b --commit 9100167 --out $OUT/prof-before > $OUT/prof-before.log 2>&1; echo prof-before rc=$?)
tail -30 $OUT/prof-before.log
rm -rf $OUT/prof-*/trace
