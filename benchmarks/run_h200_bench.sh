#!/usr/bin/env bash
# The H200 benchmark session behind docs/benchmark_results/*-h200-*.md (one device call, < 10 min).
# Usage: JAXSPEC_COMMIT=<sha> bash benchmarks/run_h200_bench.sh DEST   (writes DEST/results.tgz)
set -u
dest=${1:-out}
out=$(mktemp -d)
mkdir -p "$dest"
trap 'tar czf "$dest/results.tgz" -C "$out" .' EXIT
export PYTHONUNBUFFERED=1
sb="python3 benchmarks/speculative_bench.py --target 12b --assistant 12b --layers 8"
# 1. kernels: path table (shapes in priority order) and the qmm tile_m sweep
timeout 150 python3 benchmarks/kernel_bench.py --out "$out/k" --phase table,tiles > "$out/kernels.log" 2>&1
# 2. verify forward cost, K = 2..8, multirow on/off, padded K=2,4 with the tile_m sweep, bitwise check
timeout 170 $sb --runs forward --k-values 2,3,4,5,8 --multirow on,off --verify-pad on \
    --qmm-tile-m 16,32,64,128 --out "$out/fwd" > "$out/fwd.log" 2>&1
# 3. the loop: classic vs speculative, K=2,4, padded off/on (tile_m 16, 64); multirow off at K=4
timeout 110 $sb --runs loop --k-values 2,4 --verify-pad off,on --qmm-tile-m 16,64 --max-tokens 48 \
    --out "$out/loop" > "$out/loop.log" 2>&1
timeout 50 $sb --runs loop --k-values 4 --multirow off --max-tokens 48 --out "$out/loop_mroff" > "$out/loop_mroff.log" 2>&1
# 4. batched decode: classic scaling, speculative at B = 1, 2, 4
timeout 90 $sb --runs scaling,loop --batch 2,4 --k-values 4 --scaling-batch 1,2,4,8,16,32 --max-tokens 32 \
    --out "$out/batch" > "$out/batch.log" 2>&1
tail -n 60 "$out"/*/speculative.md 2>/dev/null | cut -c1-220
