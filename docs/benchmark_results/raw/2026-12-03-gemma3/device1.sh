#!/usr/bin/env bash
# H200 run 1 (2026-12-03): the import rename on a source checkout, the GPU kernel matrix with 8-bit g32,
# and the 4-bit matmul at Gemma 3 270M's shapes in the formats its GGUF maps to.
set -u
export PYTHONPATH=$PWD
cd "$PWD"
python3 -c "import jax, jaxspec; from jaxspec import models, kernels; print(jax.__version__, jax.devices(), models.__file__)" 2>&1 | tail -2
S=1024x640,256x640,640x1024,2048x640,640x2048,262144x640
timeout 200 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "every_path" -p no:cacheprovider 2>&1 | tail -4
for f in 8/32/f32 4/32/f32 4/64; do
  tag=$(echo $f | tr / -)
  phase=table; [ "$f" = 8/32/f32 ] && phase=check,table
  timeout 150 python3 benchmarks/kernel_bench.py --out $OUT/kb-$tag --format $f --phase $phase \
    --check-shapes $S --shapes $S --table-rows 1,4,8,16 --deadline 120 > $OUT/kb-$tag.log 2>&1
  tail -3 $OUT/kb-$tag.log
done
for f in $OUT/kb-*/kernels.jsonl; do cp $f $OUT/$(basename $(dirname $f)).jsonl; done
rm -rf $OUT/kb-*/
