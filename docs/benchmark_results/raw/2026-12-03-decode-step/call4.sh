export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
s=$(date +%s); timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_flash_attention.py > $OUT/pytest-flash-gpu.log 2>&1; echo "pytest flash gpu rc=$? $(( $(date +%s)-s ))s"; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/pytest-flash-gpu.log | tail -8
s=$(date +%s); timeout 90 python3 benchmarks/speculative_bench.py --target 12b --no-assistant --runs loop --max-tokens 32 --commit $COMMIT --out /tmp/dc > $OUT/decode-classic.log 2>&1; echo "classic rc=$? $(( $(date +%s)-s ))s"; grep "classic B" $OUT/decode-classic.log
