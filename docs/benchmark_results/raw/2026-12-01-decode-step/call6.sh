#!/bin/bash
# One-off: B = 8 classic at the new default (16-row window: a 2-token bucket) against the 8-row window
# (1-token bucket), and B = 1 classic with XLA's command buffers off, on the 12B.
export PYTHONPATH=$PWD
C=a9a596e
for w in 16 8; do
  JAXSPEC_QMV_MULTIROW_MAX_ROWS=$w timeout 110 python benchmarks/speculative_bench.py --commit $C --target 12b --no-assistant --runs loop --batch 1,8 --max-tokens 32 --out /tmp/b8w$w > /tmp/b8w$w.log 2>&1
  echo "window $w rc=$?"; grep classic /tmp/b8w$w.log
done
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 100 python benchmarks/speculative_bench.py --commit $C --target 12b --no-assistant --runs loop --max-tokens 32 --out /tmp/nocb > /tmp/nocb.log 2>&1
echo "no command buffers rc=$?"; grep classic /tmp/nocb.log
tar -czf $OUT/call6.tgz --exclude='*.png' /tmp/b8w16 /tmp/b8w8 /tmp/nocb /tmp/b8w16.log /tmp/b8w8.log /tmp/nocb.log 2>/dev/null; ls $OUT
