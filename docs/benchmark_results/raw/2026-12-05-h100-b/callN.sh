# next session's last call (the machine that holds /tmp/drafter and the GGUF): the drafter's round, then issue 70's
# leftovers: the GPU prefix-reuse exactness test and the sweep's 1 / 8 client rows, reuse on and off.
# carry: .whl .carry/callN.sh .carry/COMMIT_NEW and the default pair's two model.safetensors (the GPU test needs them)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
C=$(cat .carry/COMMIT_NEW); END=$(( $(date +%s) + ${BUDGET_S:-570} )); R=$OUT/r; mkdir -p $R
left() { echo $(( END - $(date +%s) )); }
run() { local name=$1 need=$2; shift 2; local L=$(left); [ $L -lt $need ] && { echo "== $name skipped ($L s left)"; return; }
  local t0=$(date +%s); timeout $L "$@" > $R/$name.log 2>&1; echo "== $name rc $? $(( $(date +%s) - t0 )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $R/gpu.txt
[ -d /tmp/drafter ] && { cp -r /tmp/drafter $OUT/drafter; run round 120 env TARGET=/tmp/gemma-3-270m-q4_k_m.gguf PYTHON=python3 \
  DRAFTER=/tmp/drafter OUT=$R bash benchmarks/drafter_ttt_h200.sh round --reps 5; grep -v Warning $R/round.log | tail -14 | cut -c1-240; }
[ -d /tmp/drafter ] && { run hybrid 150 python3 benchmarks/ngram_bench.py --target /tmp/gemma-3-270m-q4_k_m.gguf --assistant /tmp/drafter \
  --drafters ngram,mtp,hybrid --k-values 4 --max-tokens 64 --repeats 3 --out $R/hybrid; grep -E "^\|" $R/hybrid/ngram.md | cut -c1-200; }
run gputest 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rxXs tests/engine/test_batching_gpu.py -k prefix
tail -3 $R/gputest.log
A="--target 12b --k-values 1 --max-slots 32 --rounds-per-step 4 --prompt-len 64 --max-tokens 64 --clients 1,8 --requests-per-client 8 --sampling greedy,mixed --repeats 3 --quiet --commit $C"
for s in on off; do F=; [ $s = off ] && F=--no-prefix-cache; run sweep18_$s 100 python3 benchmarks/serve_bench.py $A $F --out $R/sweep18_$s
  grep -E "^(engine|http) " $R/sweep18_$s.log | tail -4; done
