export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
pack() { (cd $OUT && tar czf results.tgz --exclude=results.tgz --exclude='*.log' * 2>/dev/null); }
F="^W0000\|^I0000\|^E0000\|DeprecationWarning\|return rule"
timeout 110 python exp/cmdbuf_probe.py default 2>&1 | grep -v "$F" | tail -5; pack
XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL timeout 120 python exp/cmdbuf_probe.py while 2>&1 | grep -v "$F" | tail -5; pack
timeout 150 python benchmarks/serve_bench.py --target default --http --clients 1,4,8 --k-values 1,4 --rounds-per-step 4 --out $OUT/http --commit $C 2>&1 | grep -v "$F" | tail -16; pack
JAXSPEC_QMV_MULTIROW_MAX_ROWS=64 timeout 80 python benchmarks/profile_forward.py --target 12b --batch 8 --width 4 --out $OUT/p32 --commit $C 2>&1 | grep -v "$F" | tail -30; pack
timeout 70 python benchmarks/profile_forward.py --target 12b --batch 4 --width 4 --out $OUT/p16 --commit $C 2>&1 | grep -v "$F" | tail -30; pack
rm -rf $OUT/p32/trace $OUT/p16/trace; pack; ls $OUT
