#!/bin/bash
# call 2: the target stage of the default-pair recipe; a smoke run of both stages beside it checks
# the GPU paths early (the target run is stopped if the smoke fails)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 python -m jaxspec.default_pair.train --out /tmp/pair --stage target --deadline 560 > $OUT/target.log 2>&1 &
TP=$!
A="--out /tmp/sm --smoke --target-steps 30 --assistant-steps 10 --gen-seqs 16 --n-prompts 2 --eval-new-tokens 8 --ppl-windows 8 --val-windows 4"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.15
( python -m jaxspec.default_pair.train $A --stage target && python -m jaxspec.default_pair.train $A --stage assistant --a-layers 1 ) > $OUT/smoke.log 2>&1
SRC=$?
echo smoke rc $SRC; grep -v "^\s*$" $OUT/smoke.log | tail -8 | cut -c1-400
if [ $SRC != 0 ]; then kill $TP; sleep 2; fi
wait $TP; echo target rc $?
grep -v "^\s*$" $OUT/target.log | tail -40
cd /tmp && tar cf - pair | split -b 15m - $OUT/pair.tar.
ls -la $OUT
