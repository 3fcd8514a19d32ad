export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
C=${COMMIT:-HEAD}
s=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/test_flash_attention.py tests/test_decode_attention.py tests/test_attention_inputs.py > $OUT/pytest-gpu.log 2>&1; echo "pytest gpu rc=$? $(( $(date +%s)-s ))s"; tail -3 $OUT/pytest-gpu.log
s=$(date +%s); timeout 90 python3 benchmarks/speculative_bench.py --target 12b --no-assistant --runs loop --max-tokens 32 --commit $C --out /tmp/dc > $OUT/decode-classic.log 2>&1; echo "classic rc=$? $(( $(date +%s)-s ))s"; grep "classic B" $OUT/decode-classic.log
s=$(date +%s); timeout 120 python3 benchmarks/profile_forward.py --target 12b --context 128 --steps 4 --commit $C --out /tmp/p128 > $OUT/profile.log 2>&1; echo "profile rc=$? $(( $(date +%s)-s ))s"; cp /tmp/p128/*.md $OUT/profile-128.md 2>/dev/null; cp /tmp/p128/*.json $OUT/profile-128.json 2>/dev/null; sed -n 8,30p $OUT/profile-128.md
s=$(date +%s); timeout 260 python3 benchmarks/context_bench.py --target 12b --context 8192,131072 --max-tokens 16 --repeats 1 --time-budget 230 --commit $C --out /tmp/ctx > $OUT/context.log 2>&1; echo "context rc=$? $(( $(date +%s)-s ))s"; cp /tmp/ctx/*.md $OUT/ 2>/dev/null; tail -12 $OUT/context.log
ls $OUT
