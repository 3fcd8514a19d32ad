# drafter chain, call 6 (same warm machine): train (MIN minutes, default 9), keep the drafter in /tmp for the round
export PYTHONUNBUFFERED=1 TARGET=/tmp/gemma-3-270m-q4_k_m.gguf PYTHON=python3
bash benchmarks/drafter_ttt_h200.sh train --minutes ${MIN:-9} $EXTRA; rc=$?
cp -r $OUT/drafter /tmp/drafter; echo "train rc $rc"; ls -la $OUT/drafter
