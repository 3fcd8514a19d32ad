export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit
F="^W0000\|^I0000\|^E0000\|DeprecationWarning\|return rule"
timeout 150 python benchmarks/serve_bench.py --target 12b --clients 1,8,32 --k-values 1 --max-slots 32 --rounds-per-step 4 --prompt-len 64 --out $OUT/s12b_r4 --commit $C 2>&1 | grep -v "$F" | tail -5
timeout 100 python benchmarks/serve_bench.py --target 12b --clients 1,8 --k-values 1 --rounds-per-step 1 --prompt-len 64 --out $OUT/s12b_r1 --commit $C 2>&1 | grep -v "$F" | tail -4
timeout 110 python benchmarks/serve_bench.py --target default --http --clients 1,4,8 --k-values 1,4 --rounds-per-step 1 --out $OUT/http_r1 --commit $C 2>&1 | grep -v "$F" | tail -15
ls $OUT
