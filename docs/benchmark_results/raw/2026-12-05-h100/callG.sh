# serve guard, reduced to 32 clients (engine + HTTP, greedy + mixed, median of 3): this tree against .carry/serve-old (3231fb3)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONUNBUFFERED=1
C=$(cat .carry/COMMIT_NEW); R=$OUT/g; mkdir -p $R
A="--target 12b --k-values 1 --max-slots 32 --rounds-per-step 4 --prompt-len 64 --max-tokens 64 --clients 32 --sampling greedy,mixed --requests-per-client 8 --http --repeats 3 --quiet"
for t in new old; do T=$PWD; CC=$C; [ $t = old ] && { T=$PWD/.carry/serve-old; CC=$(cat $T/COMMIT); }
  t0=$(date +%s); (cd $T && PYTHONPATH=$T:/tmp/site timeout ${GT:-200} python3 benchmarks/serve_bench.py $A --commit $CC --out $R/$t > $R/$t.log 2>&1); echo "== $t rc $? $(( $(date +%s) - t0 )) s"
  grep -E "^(engine|http) " $R/$t.log | tail -4; done
