# issue 70's 32-client sweep rows (engine + HTTP, greedy + mixed, median of 3), reuse on then off, one
# call, in serve_guard's layout (DIR/sweep/serve.json + guard.json) for `serve_guard.py compare`
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
C=$(cat .carry/COMMIT_NEW)
for s in on off; do F=; PC=true; [ $s = off ] && F=--no-prefix-cache && PC=false; t0=$(date +%s); mkdir -p $OUT/$s
  timeout ${PART_S:-190} python3 benchmarks/serve_bench.py --target 12b --k-values 1 --max-slots 32 --rounds-per-step 4 --prompt-len 64 --max-tokens 64 --clients 32 --sampling ${SAMPLING:-greedy,mixed} --requests-per-client 8 --http --quiet --repeats 3 $F --commit $C --out $OUT/$s/sweep > $OUT/$s/sweep.log 2>&1
  echo "== $s rc $? $(( $(date +%s) - t0 )) s"
  echo "{\"tree\": \".\", \"commit\": \"$C\", \"parts\": [\"sweep\"], \"repeats\": true, \"prefix_cache\": $PC, \"clients\": [32]}" > $OUT/$s/guard.json
  grep -E "^(engine|http) " $OUT/$s/sweep.log; grep -iE "error|Traceback" $OUT/$s/sweep.log | head -3; done
