#!/bin/bash
# One-off (#24, second session): attention_inputs on the H200 -- its gpu tests, classic decode A/B
# against 2da13d6 (alternating), K = 4 with the assistant, a profile, and XLA's flag list.
export PYTHONPATH=$PWD
C=2da13d6+attention_inputs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/test_attention_inputs.py tests/test_decode_attention.py -p no:cacheprovider > /tmp/gpu-tests.log 2>&1; echo gpu tests rc=$?; tail -3 /tmp/gpu-tests.log
for i in 1 2; do
  timeout 100 python benchmarks/speculative_bench.py --commit $C --target 12b --no-assistant --runs loop --max-tokens 32 --out /tmp/after-$i > /tmp/after-$i.log 2>&1; echo after rc=$?; grep "classic B" /tmp/after-$i.log
  (cd exp/before && PYTHONPATH=$PWD timeout 100 python benchmarks/speculative_bench.py --commit 2da13d6 --target 12b --no-assistant --runs loop --max-tokens 32 --out /tmp/before-$i > /tmp/before-$i.log 2>&1; echo before rc=$?); grep "classic B" /tmp/before-$i.log
done
timeout 150 python benchmarks/speculative_bench.py --commit $C --target 12b --assistant 12b --runs loop --k-values 4 --max-tokens 32 --out /tmp/k4 > /tmp/k4.log 2>&1; echo k4 rc=$?; grep "^| spec\|^| classic" /tmp/k4/*.md | head
timeout 100 python benchmarks/profile_forward.py --target 12b --commit $C --out /tmp/prof > /tmp/prof.log 2>&1; echo prof rc=$?; tail -25 /tmp/prof.log
XLA_FLAGS=--help timeout 60 python -c "import jax; jax.numpy.zeros(3)" > /tmp/xla-help.txt 2>&1; grep -i "softmax\|block_level\|multi_output\|command_buffer" /tmp/xla-help.txt | head -20
rm -rf /tmp/prof/trace
tar -czf $OUT/call1.tgz --exclude='*.png' /tmp/gpu-tests.log /tmp/after-* /tmp/before-* /tmp/k4* /tmp/prof* /tmp/xla-help.txt 2>/dev/null; ls -la $OUT
