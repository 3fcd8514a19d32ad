#!/bin/bash
# call 2: the target stage with the bf16 backward (einsum_f32); beside it, first the step time
# without deterministic ops (while the stage reads its corpus), then a smoke run of both stages
# (the target run is stopped if the smoke fails)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 python -m jaxspec.default_pair.train --out /tmp/pair --stage target --deadline 515 > $OUT/target.log 2>&1 &
TP=$!
XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 100 python docs/benchmark_results/raw/2026-12-02-default-pair-retrain/step_profile.py $OUT/steps.jsonl t_nodet_bf16bwd '{"what":"target"}' > $OUT/steps.log 2>&1
echo steps rc $?; tail -2 $OUT/steps.log
A="--out /tmp/sm --smoke --target-steps 30 --assistant-steps 10 --gen-seqs 16 --n-prompts 2 --eval-new-tokens 8 --ppl-windows 8 --val-windows 4"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.15
( python -m jaxspec.default_pair.train $A --stage target && python -m jaxspec.default_pair.train $A --stage assistant --a-layers 1 ) > $OUT/smoke.log 2>&1
SRC=$?
echo smoke rc $SRC; grep -v "^\s*$" $OUT/smoke.log | tail -8 | cut -c1-400
if [ $SRC != 0 ]; then kill $TP; sleep 2; fi
wait $TP; echo target rc $?
grep -v "^\s*$" $OUT/target.log | grep -v "target: step [0-9]*/" | tail -20
grep "target: step [0-9]*/" $OUT/target.log | tail -3
cd /tmp && tar cf - pair | split -b 15m - $OUT/pair.tar.
ls -la $OUT
