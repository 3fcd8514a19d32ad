#!/usr/bin/env bash
# The H200 benchmark session behind docs/benchmark_results/speculative-h200-*.md (one device call,
# < 10 min: 585 s of step timeouts). Usage: JAXSPEC_COMMIT=<sha> bash benchmarks/run_h200_bench.sh DEST  (writes DEST/results.tgz)
# Each step has a hard timeout and a softer --time-budget (no new configuration starts after it).
set -u
dest=${1:-out}
out=$(mktemp -d)
mkdir -p "$dest"
trap 'tar czf "$dest/results.tgz" -C "$out" .' EXIT
export PYTHONUNBUFFERED=1
sb="python3 benchmarks/speculative_bench.py --target 12b --assistant 12b"
slice="$sb --layers 8"
# 1. the whole 48-layer 12B: decode at B = 1 against the weight-bytes floor, verify K = 4, bitwise;
#    then decode again with the kernels' scale prefetch (JAXSPEC_PREFETCH_SB=1, docs/kernels.md entry 3)
timeout 100 $sb --no-assistant --runs forward --k-values 4 --time-budget 60 --out "$out/full" > "$out/full.log" 2>&1
JAXSPEC_PREFETCH_SB=1 timeout 70 $sb --no-assistant --runs forward --k-values "" --out "$out/full_pf" \
    > "$out/full_pf.log" 2>&1
# 2. 12B slice: verify cost K = 2..8 with multirow on/off, padded K = 2, 4 (tile_m 64), a draft step
timeout 100 $slice --runs forward --k-values 2,3,4,5,6,8 --multirow on,off --verify-pad on \
    --pad-k-values 2,4 --qmm-tile-m 64 --time-budget 70 --out "$out/fwd" > "$out/fwd.log" 2>&1
# 3. the loop on the slice: classic vs speculative K = 4, 2 (unpadded), then K = 4 with multirow off
timeout 70 $slice --runs loop --k-values 4,2 --max-tokens 32 --time-budget 50 --out "$out/loop" \
    > "$out/loop.log" 2>&1
timeout 40 $slice --runs loop --k-values 4 --multirow off --max-tokens 32 --time-budget 20 \
    --out "$out/loop_mroff" > "$out/loop_mroff.log" 2>&1
# 4. batched decode on the slice: classic scaling to B = 32, then speculative K = 4 at B = 4
timeout 80 $slice --no-assistant --runs scaling --scaling-batch 1,2,4,8,16,32 --max-tokens 32 \
    --time-budget 60 --out "$out/scaling" > "$out/scaling.log" 2>&1
timeout 40 $slice --runs loop --batch 4 --k-values 4 --max-tokens 32 --time-budget 20 \
    --out "$out/batch" > "$out/batch.log" 2>&1
# 5. the shipped default pair: the padded-vs-unpadded A/B with real acceptance (its first held-out
#    prompt; `train_default_pair.py --eval-only --out DIR` measures all 20 prompts at K = 4)
timeout 85 python3 benchmarks/speculative_bench.py --target default --runs loop --k-values 4,2 \
    --verify-pad off,on --qmm-tile-m 64 --max-tokens 64 --time-budget 70 --out "$out/pair" > "$out/pair.log" 2>&1
for f in "$out"/*.log; do echo "== $f"; grep -v Warning "$f" | grep -v "^  res = \|^    return rule" | tail -n 25 | cut -c1-300; done
