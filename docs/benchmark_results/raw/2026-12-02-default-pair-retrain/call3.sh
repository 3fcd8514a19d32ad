#!/bin/bash
# call 3: the assistant stage (1 layer, FFN 3072) on call 2's target, then the recipe's evaluation
# exp/pair: call 2's /tmp/pair (its pair.tar.* files), unpacked in the repo and sent with the working tree
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python -m jaxspec.default_pair.train --out exp/pair --stage assistant --deadline 455 > $OUT/assistant.log 2>&1
echo assistant rc $?
grep -v "^\s*$" $OUT/assistant.log | grep -v "assistant: step [0-9]*/" | tail -14 | cut -c1-600
tar czf $OUT/assistant.tgz -C exp/pair assistant metrics.json
ls -la $OUT
