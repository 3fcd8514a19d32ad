# drafter chain call 1 (p0 to /tmp/gg) + issue 70's H200 half: prefix TTFT at 16,384 / 4,096 and the sweep at 32 clients, reuse on / off
true
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=$(cat .carry/COMMIT_NEW); R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $R/gpu.txt
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a $R/gpu.txt
t0=$(date +%s)
timeout 240 python3 benchmarks/prefix_bench.py --target 12b --prefix-len 16384,4096 --commit $C --out $R/prefix > $R/prefix.log 2>&1; echo "== prefix rc $? $(( $(date +%s) - t0 )) s"
grep -E "^\|" $R/prefix/prefix.md | head -12 | cut -c1-220; tail -3 $R/prefix.log | cut -c1-300
A="--target 12b --k-values 1 --max-slots 32 --rounds-per-step 4 --prompt-len 64 --max-tokens 64 --clients 32 --requests-per-client 8 --sampling greedy --repeats 3 --quiet --commit $C"
for s in on off; do t0=$(date +%s); F=; [ $s = off ] && F=--no-prefix-cache
  timeout 140 python3 benchmarks/serve_bench.py $A $F --out $R/sweep_$s > $R/sweep_$s.log 2>&1; echo "== sweep_$s rc $? $(( $(date +%s) - t0 )) s"
  grep -E "^(engine|http) " $R/sweep_$s.log | tail -2; done

