#!/bin/bash
# One-off (#25): why one 12B stream through the engine runs 124-129 tok/s (generate: 197): rounds per
# step 1 / 4, and XLA command buffers off.
export PYTHONPATH=$PWD
C=$(git rev-parse --short HEAD 2>/dev/null || echo wip)+rounds-option
B="python benchmarks/serve_bench.py --commit $C --target 12b --assistant 12b --clients 1,8 --k-values 1 --prompt-len 64"
timeout 100 $B --rounds-per-step 4 --out /tmp/r4 > /tmp/r4.log 2>&1; echo r4 rc=$?; grep "^K=" /tmp/r4.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 100 $B --out /tmp/nocb > /tmp/nocb.log 2>&1; echo nocb rc=$?; grep "^K=" /tmp/nocb.log
tar -czf $OUT/call5.tgz /tmp/r4* /tmp/nocb* 2>/dev/null
