#!/bin/bash
# call 1 (#26 second session): where the training steps' time goes. Compile every variant in parallel
# into a persistent cache, then time and profile them one at a time.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
DET="--xla_gpu_deterministic_ops=true"
V=(
 "t_det|$DET|{\"what\":\"target\"}"
 "t_nodet||{\"what\":\"target\"}"
 "t_det_onehot|$DET|{\"what\":\"target\",\"onehot\":true}"
 "t_nodet_onehot||{\"what\":\"target\",\"onehot\":true}"
 "t_nodet_b256||{\"what\":\"target\",\"batch\":256}"
 "a_det|$DET|{\"what\":\"assistant\"}"
 "a_nodet||{\"what\":\"assistant\"}"
)
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.13
for v in "${V[@]}"; do IFS='|' read n f c <<< "$v"
  XLA_FLAGS="$f" timeout 240 python docs/benchmark_results/raw/2026-12-02-default-pair-retrain/step_profile.py /tmp/warm.jsonl $n "$c" > $OUT/warm-$n.log 2>&1 &
done
wait
echo warm done $(date)
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.8
for v in "${V[@]}"; do IFS='|' read n f c <<< "$v"
  XLA_FLAGS="$f" timeout 120 python docs/benchmark_results/raw/2026-12-02-default-pair-retrain/step_profile.py $OUT/steps.jsonl $n "$c" > $OUT/run-$n.log 2>&1; echo $n rc $?
done
cat /tmp/warm.jsonl | cut -c1-150
cd $OUT && tar czf logs.tgz *.log && rm *.log
