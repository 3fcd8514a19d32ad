#!/bin/bash
# One-off (#25): serve_bench on the H200, the 12B preset (random weights) and the default pair.
export PYTHONPATH=$PWD
C=$(git rev-parse --short HEAD 2>/dev/null || echo 99ec8e7)+serve_bench
timeout 330 python benchmarks/serve_bench.py --commit $C --target 12b --assistant 12b --clients 1,4,8,16 --k-values 1 --prompt-len 64 --out /tmp/sb12 > /tmp/sb12.log 2>&1; echo 12b classic rc=$?; grep "^K=" /tmp/sb12.log
timeout 200 python benchmarks/serve_bench.py --commit $C --target 12b --assistant 12b --clients 1,4,8 --k-values 4 --prompt-len 64 --out /tmp/sb12k4 > /tmp/sb12k4.log 2>&1; echo 12b k4 rc=$?; grep "^K=" /tmp/sb12k4.log
timeout 120 python benchmarks/serve_bench.py --commit $C --target default --clients 1,4,8 --k-values 1,4 --out /tmp/sbdp > /tmp/sbdp.log 2>&1; echo default rc=$?; grep "^K=" /tmp/sbdp.log
tar -czf $OUT/call3.tgz /tmp/sb12* /tmp/sbdp* 2>/dev/null; ls -la $OUT
