#!/bin/bash
# call 3: the assistant stage on the target from call 2, two drafters trained side by side (1 layer
# with a wide FFN: fewer launches per draft step; 2 layers as before), then each measured alone
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=jaxspec/default_pair
for v in a1 a2; do mkdir -p /tmp/$v && cp -r $D/target $D/tokenizer.json $D/heldout_prompts.json $D/metrics.json /tmp/$v/; done
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
python -m jaxspec.default_pair.train --out /tmp/a1 --stage assistant --a-layers 1 --a-ffn 3072 --deadline 310 --eval-reserve 8 --no-eval > $OUT/a1.log 2>&1 &
P1=$!
python -m jaxspec.default_pair.train --out /tmp/a2 --stage assistant --a-layers 2 --deadline 310 --eval-reserve 8 --no-eval > $OUT/a2.log 2>&1
echo a2 rc $?; wait $P1; echo a1 rc $?
grep -v "^\s*$" $OUT/a1.log | grep -v "assistant: step" | tail -12 | cut -c1-300
grep -v "^\s*$" $OUT/a2.log | tail -4 | cut -c1-300
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.75
for v in a1 a2; do timeout 118 python -m jaxspec.default_pair.train --out /tmp/$v --eval-only --deadline 108 > $OUT/eval-$v.log 2>&1; echo eval $v rc $?; grep "eval speculative\|eval plausib" $OUT/eval-$v.log | cut -c1-200; done
cd /tmp && tar czf $OUT/pairs.tgz a1/assistant a1/metrics.json a2/assistant a2/metrics.json
ls -la $OUT
