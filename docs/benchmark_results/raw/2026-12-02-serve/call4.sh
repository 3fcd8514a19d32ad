#!/bin/bash
# One-off (#25): serve_bench with pipelined steps (now) against f4c1901 (a host read between rounds).
export PYTHONPATH=$PWD
C=$(git rev-parse --short HEAD 2>/dev/null || echo wip)
timeout 170 python benchmarks/serve_bench.py --commit $C --target 12b --assistant 12b --clients 1,4,8,16 --k-values 1 --prompt-len 64 --out /tmp/sb12 > /tmp/sb12.log 2>&1; echo 12b classic rc=$?; grep "^K=" /tmp/sb12.log
(cd exp/before && PYTHONPATH=$PWD timeout 110 python benchmarks/serve_bench.py --commit f4c1901 --target 12b --assistant 12b --clients 1,8 --k-values 1 --prompt-len 64 --out /tmp/sb12-before > /tmp/sb12-before.log 2>&1; echo before rc=$?); grep "^K=" /tmp/sb12-before.log
timeout 150 python benchmarks/serve_bench.py --commit $C --target 12b --assistant 12b --clients 1,4,8 --k-values 4 --prompt-len 64 --out /tmp/sb12k4 > /tmp/sb12k4.log 2>&1; echo 12b k4 rc=$?; grep "^K=" /tmp/sb12k4.log
timeout 90 python benchmarks/serve_bench.py --commit $C --target default --clients 1,4,8 --k-values 1,4 --out /tmp/sbdp > /tmp/sbdp.log 2>&1; echo default rc=$?; grep "^K=" /tmp/sbdp.log
tar -czf $OUT/call4.tgz /tmp/sb12* /tmp/sbdp* 2>/dev/null; ls -la $OUT
