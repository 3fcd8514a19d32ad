#!/usr/bin/env bash
# The H200 benchmark session behind docs/benchmark_results/speculative-h200-*.md (one device call,
# < 10 min: 590 s of step timeouts). Usage: JAXSPEC_COMMIT=<sha> bash benchmarks/run_h200_bench.sh DEST  (writes DEST/results.tgz)
# Each step has a hard timeout and a softer --time-budget (no new configuration starts after it).
# Ordered by what the last session (89c8711) left unmeasured; the rows it measured come last.
set -u
dest=${1:-out}
out=$(mktemp -d)
mkdir -p "$dest"
trap 'tar czf "$dest/results.tgz" -C "$out" .' EXIT
export PYTHONUNBUFFERED=1
sb="python3 benchmarks/speculative_bench.py --target 12b --assistant 12b"
slice="$sb --layers 8"
# 1. where a whole-12B decode forward's time goes: kernel time by kind, idle gaps (profile.md)
timeout 110 python3 benchmarks/profile_forward.py --target 12b --steps 4 --out "$out/profile" > "$out/profile.log" 2>&1
#    and the PTX this jaxlib's bundled Triton builds for both GEMVs (docs/kernels.md, next steps)
for kern in mma fma; do
    timeout 15 python3 benchmarks/triton_ir.py --device --rows 1 --kernel $kern --out "$out/ptx_$kern" \
        > "$out/ptx_$kern.log" 2>&1
done
# 2. slice: verify cost with multirow off (the seed's linear-in-K regression, at the model level)
timeout 90 $slice --runs forward --k-values 2,4,8 --multirow off --pad-k-values "" --time-budget 65 \
    --out "$out/fwd_off" > "$out/fwd_off.log" 2>&1
# 3. the loop on the slice: K = 2; B = 4 with K = 4 (the probe now shrinks K to the row bucket, 2);
#    speculative with multirow off
timeout 60 $slice --runs loop --k-values 2 --max-tokens 32 --time-budget 45 --out "$out/loop_k2" > "$out/loop_k2.log" 2>&1
timeout 70 $slice --runs loop --batch 4 --k-values 4 --max-tokens 32 --time-budget 55 --out "$out/batch" \
    > "$out/batch.log" 2>&1
timeout 60 $slice --runs loop --k-values 4 --multirow off --max-tokens 32 --time-budget 45 \
    --out "$out/loop_mroff" > "$out/loop_mroff.log" 2>&1
# 4. again, the rows measured before: whole 12B decode and verify K = 4; the slice's K = 2..8; the
#    loop at K = 4; batched scaling; the default pair's padded A/B
timeout 80 $sb --no-assistant --runs forward --k-values 4 --time-budget 45 --out "$out/full" > "$out/full.log" 2>&1
timeout 60 $slice --runs forward --k-values 2,4,8 --pad-k-values 4 --verify-pad on --qmm-tile-m 64 \
    --time-budget 40 --out "$out/fwd" > "$out/fwd.log" 2>&1
timeout 30 $slice --no-assistant --runs scaling --scaling-batch 1,8,32 --max-tokens 32 --time-budget 20 \
    --out "$out/scaling" > "$out/scaling.log" 2>&1
for f in "$out"/*.log; do echo "== $f"; grep -v Warning "$f" | grep -v "^  res = \|^    return rule" | tail -n 25 | cut -c1-300; done
