#!/usr/bin/env bash
# H200 run 2 (2026-12-03, commit 6b75414): Gemma 3 on the GPU's Pallas path against transformers (tiny
# random HF models) and the kernels; classic decode and the verify's cost at Gemma 3 270M's shapes
# (random 4-bit g64 weights); the 8-bit g32 float32-scale GEMV table at its shapes.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=1024x640,256x640,640x1024,2048x640,640x2048,262144x640
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_gemma3.py tests/test_kernels_gpu.py -k "not 2-64 and not 4-128 and not 8-64" 2>&1 | tail -4
timeout 200 python3 benchmarks/speculative_bench.py --target gemma-3-270m --no-assistant --runs forward,loop \
  --k-values 4 --pad-k-values 2,4 --max-tokens 128 --commit 6b75414 --out $OUT/sb > $OUT/sb.log 2>&1; tail -25 $OUT/sb.log
timeout 100 python3 benchmarks/kernel_bench.py --out $OUT/kb --format 8/32/f32 --phase table --shapes $S \
  --table-rows 1,4,8,16 --commit 6b75414 --deadline 80 > $OUT/kb-8-32-f32.log 2>&1; tail -2 $OUT/kb-8-32-f32.log
cp $OUT/kb/kernels.jsonl $OUT/kb-8-32-f32.jsonl; rm -rf $OUT/kb; ls $OUT/sb
