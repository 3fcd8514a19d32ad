export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
i=0
b() { i=$((i+1)); s=$(date +%s); JAXSPEC_QMV_MULTIROW_MAX_ROWS=$1 timeout 80 python3 benchmarks/speculative_bench.py --target 12b --no-assistant --runs loop --max-tokens 32 --commit 50f4b3b --out /tmp/b$i > $OUT/b$i-rows$1.log 2>&1; echo "run $i multirow_max_rows=$1 rc=$? $(( $(date +%s)-s ))s $(grep 'classic B' $OUT/b$i-rows$1.log)"; }
b 16; b 1; b 16; b 1
