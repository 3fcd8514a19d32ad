export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}
pack() { (cd $OUT && tar czf results.tgz --exclude=results.tgz --exclude='*.log' * 2>/dev/null); }
F="^W0000\|^I0000\|^E0000"
timeout 150 python exp/overhead_probe.py 2>&1 | grep -v "$F" | tail -30 | tee $OUT/overhead.log; pack
timeout 110 python benchmarks/kernel_bench.py --out $OUT/kb --phase table --shapes 15360x3840,3840x15360,4096x3840 --table-rows 16,32,64 --commit $C 2>&1 | grep -v "$F" | tail -25; pack
timeout 90 python -m pytest -q -m gpu tests/test_kernels_gpu.py -k "past_16 or fused or gemv_compiles" -p no:cacheprovider 2>&1 | tail -8 | tee $OUT/gpu_tests.log; pack
JAXSPEC_QMV_MULTIROW_MAX_ROWS=64 timeout 100 python benchmarks/serve_bench.py --target 12b --clients 8,16 --k-values 4 --prompt-len 64 --out $OUT/s64 --commit $C 2>&1 | grep -v "$F" | tail -4; pack
timeout 80 python benchmarks/serve_bench.py --target 12b --clients 32 --k-values 1 --max-slots 32 --prompt-len 64 --out $OUT/s32 --commit $C 2>&1 | grep -v "$F" | tail -3; pack
JAXSPEC_QMV_MULTIROW_MAX_ROWS=64 timeout 60 python benchmarks/serve_bench.py --target default --clients 8 --k-values 1,4 --out $OUT/sdef --commit $C 2>&1 | grep -v "$F" | tail -4; pack
ls -la $OUT
