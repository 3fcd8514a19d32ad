# final call: the drafter's round (on this warm machine's /tmp), issue 66's K = 4 at 8 slots with the GEMV up to
# 32 rows and its price at 32 slots, issue 70's prefix TTFT and the sweep at 32 clients with reuse on / off
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
C=$(cat .carry/COMMIT_NEW); END=$(( $(date +%s) + ${BUDGET_S:-560} ))
R=$OUT/r; mkdir -p $R
pack() { tar czf $OUT/callF.tgz -C $R .; }
left() { echo $(( END - $(date +%s) )); }
run() { local name=$1 need=$2; shift 2; local L=$(left); [ $L -lt $need ] && { echo "== $name skipped ($L s left)"; return; }
  local t0=$(date +%s); timeout $L "$@" > $R/$name.log 2>&1; echo "== $name rc $? $(( $(date +%s) - t0 )) s"; pack; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/gpu.txt; cat $R/gpu.txt
[ -d /tmp/drafter ] && run round 100 env TARGET=/tmp/gemma-3-270m-q4_k_m.gguf PYTHON=python3 DRAFTER=/tmp/drafter OUT=$R \
  bash benchmarks/drafter_ttt_h200.sh round --reps 5 --vocab 16384 8192
grep -v Warning $R/round.log | tail -14 | cut -c1-220
A="--target 12b --k-values 1 --max-slots 32 --rounds-per-step 4 --prompt-len 64 --max-tokens 64 --clients 32 --requests-per-client 8 --sampling greedy --quiet --commit $C"
run adm_new 70 python3 benchmarks/serve_bench.py $A --commit $C+hostadmit --out $R/adm_new
grep -E "^(engine|http) " $R/adm_new.log | tail -2
cp jaxspec/engine/batching.py jaxspec/engine/sampling.py /tmp/; cp .carry/old/batching.py .carry/old/sampling.py jaxspec/engine/
run adm_old 70 python3 benchmarks/serve_bench.py $A --out $R/adm_old
grep -E "^(engine|http) " $R/adm_old.log | tail -2
cp /tmp/batching.py /tmp/sampling.py jaxspec/engine/
MR="pallas_kernels/config.py pallas_kernels/dispatch.py pallas_kernels/launch.py models/target.py"
mkdir -p /tmp/orig; for f in $MR; do cp $f /tmp/orig/; cp .carry/mr/$(basename $f) $f; done   # branch gemv-row-tiles
run k4 90 env JAXSPEC_QMV_MULTIROW_MAX_ROWS=32 python3 -m pytest -q -p no:cacheprovider -m gpu -rxX tests/engine/test_batching_gpu.py
tail -6 $R/k4.log | cut -c1-300
run mr32 70 env JAXSPEC_QMV_MULTIROW_MAX_ROWS=32 python3 benchmarks/serve_bench.py $A --commit $C+hostadmit+rowtiles32 --out $R/mr32
grep -E "^(engine|http) " $R/mr32.log | tail -2
run mrk 60 env R=$R python3 .carry/mr_kernel.py
grep "'rows'" $R/mrk.log | cut -c1-120 | paste - - | head -16
for f in $MR; do cp /tmp/orig/$(basename $f) $f; done
run prefix 150 python3 benchmarks/prefix_bench.py --target 12b --prefix-len 16384,4096 --commit $C+hostadmit --out $R/prefix
grep -E "^\|" $R/prefix/prefix.md | head -12 | cut -c1-220
