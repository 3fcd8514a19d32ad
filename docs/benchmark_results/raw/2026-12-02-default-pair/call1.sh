#!/bin/bash
# call 1: where the shipped pair's round goes, training-step throughput, the corpus on this machine
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
C=$1
mkdir -p $OUT/r
python exp/corpus_probe.py $OUT/r/corpus.json > $OUT/r/corpus.log 2>&1 &
CP=$!
python benchmarks/profile_forward.py --target default --draft --steps 3 --commit $C --out /tmp/pd 2>&1 | tail -30
cp /tmp/pd/profile.md $OUT/r/profile-draft.md; cp /tmp/pd/profile.json $OUT/r/profile-draft.json
python benchmarks/profile_forward.py --target default --width 4 --steps 8 --commit $C --out /tmp/pv 2>&1 | tail -12
cp /tmp/pv/profile.md $OUT/r/profile-verify4.md; cp /tmp/pv/profile.json $OUT/r/profile-verify4.json
timeout 120 python exp/drafter_probe.py $OUT/r/drafter.jsonl 2>&1 | grep -v Warning | tail -12
XLA_FLAGS=--xla_gpu_deterministic_ops=true timeout 60 python exp/steps.py $OUT/r/steps-det.jsonl '[{"name":"base-b128-det","batch":128}]' 2>&1 | grep '^{'
timeout 150 python exp/steps.py $OUT/r/steps.jsonl '[{"name":"base-b64","batch":64},{"name":"base-b128","batch":128},{"name":"wide640-b128","batch":128,"hidden":640,"heads":10,"ffn":2048}]' 2>&1 | grep '^{'
wait $CP; cat $OUT/r/corpus.log | tail -3
cd $OUT && tar czf r.tgz r && rm -rf r
