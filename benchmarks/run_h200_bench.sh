#!/usr/bin/env bash
# The H200 benchmark session behind docs/benchmark_results/speculative-h200-*.md, as named steps that
# fit one device call (< 10 min each set). Usage:
#   JAXSPEC_COMMIT=<sha> bash benchmarks/run_h200_bench.sh DEST [step ...]   (writes DEST/results.tgz)
# Default steps: all, unmeasured ones first (about 1700 s of step timeouts: more than one call; name a subset).
# Each step has a hard timeout and, where the tool has one, a softer --time-budget. The results are
# re-packed after every step, so a call cut short still returns what finished.
set -u
dest=${1:-out}
shift || true
steps=${*:-loop_mroff pad_sweep loop_b2 loop_full profile fwd_off loops probe ncu full fwd scaling}
out=$(mktemp -d)
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
sb="python3 benchmarks/speculative_bench.py --target 12b --assistant 12b"
slice="$sb --layers 8"
step() {  # name timeout command...: run, log, re-pack
    local name=$1 t=$2; shift 2
    timeout "$t" "$@" > "$out/$name.log" 2>&1
    echo "== $name (rc $?)"
    grep -v Warning "$out/$name.log" | grep -v "^  res = \|^    return rule" | tail -n 22 | cut -c1-300
    tar czf "$dest/results.tgz" -C "$out" .
}
for s in $steps; do
    case $s in
    # where a whole-12B decode forward's time goes: kernel time by kind, idle gaps (profile.md)
    profile) step profile 110 python3 benchmarks/profile_forward.py --target 12b --steps 4 --out "$out/profile" ;;
    # slice: verify cost with multirow off (the seed's linear-in-K regression, at the model level)
    fwd_off) step fwd_off 85 $slice --runs forward --k-values 2,4,8 --multirow off --pad-k-values "" \
        --time-budget 60 --out "$out/fwd_off" ;;
    # the loop on the slice: K = 2; B = 4 with K = 4 (the probe shrinks K to the row bucket, 2)
    # (a loop configuration takes 20-40 s to compile and run: 55 s steps finished only the classic row)
    loops) step loops 210 $slice --runs loop --batch 4,1 --k-values 4,2 --max-tokens 32 --time-budget 160 \
        --out "$out/loops" ;;
    # the multirow window at 16 rows (the tensor-core GEMV's MMA tile: no extra weight traffic), so
    # that B = 4 keeps K = 4 inside it (session 4: the 16-row verify went to qmm and the probe cut K to 2)
    loops16) JAXSPEC_QMV_MULTIROW_MAX_ROWS=16 step loops16 200 $slice --runs loop --batch 4,1 --k-values 4 \
        --max-tokens 32 --time-budget 150 --out "$out/loops16" ;;
    # (with multirow off decode runs 1 row and verify K, so the exactness probe falls back to classic:
    # session 4; skip it to measure the round cost, the parity column says whether greedy still held)
    loop_mroff) step loop_mroff 100 $slice --runs loop --k-values 4 --multirow off --exactness-probe off \
        --max-tokens 32 --time-budget 60 --out "$out/loop_mroff" ;;
    # never measured since split-K (session 4): the padded verify's tile_m sweep at K = 2 and 4, and
    # speculative decoding at B = 2
    pad_sweep) step pad_sweep 150 $slice --runs forward --k-values 2,4 --pad-k-values 2,4 --verify-pad on \
        --qmm-tile-m 16,32,64,128 --time-budget 120 --out "$out/pad_sweep" ;;
    loop_b2) step loop_b2 100 $slice --runs loop --batch 2 --k-values 4 --max-tokens 32 --time-budget 60 \
        --out "$out/loop_b2" ;;
    # the whole 48-layer model's K = 4 round (only the 8-layer slice's has been measured)
    # (session 6: 200 s ended after the classic row; building and compiling both loops takes most of it;
    # session 8: 320 s ended after the classic row too, with fused launches: give it a call of its own)
    loop_full) step loop_full 560 $sb --runs loop --k-values 4 --max-tokens 32 --time-budget 500 \
        --out "$out/loop_full" ;;
    # Nsight Compute's own kernel durations, DRAM throughput, registers, executed instructions and
    # warp stall reasons (the device's truth; triton_ir.py's pip-Triton counts are a proxy) for both
    # GEMVs at 1 and 8 rows and two stream kernels (no preallocation: kernel replay saves and
    # restores device memory). Next question (docs/kernels.md): why the fma GEMV costs 20 us at one
    # row and several times that at 8.
    # (session 5: plus the memory, compute, scheduler and instruction sections, the best 8-row fma
    # launch, and the tensor-core GEMV split further at one group per step: the group-chain test)
    ncu) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu 150 ncu --clock-control none --kernel-name regex:'q4|stream' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section SchedulerStats --section InstructionStats python3 benchmarks/gemv_probe.py --once --rows 1,8 \
        --only "=gemv mma,=gemv fma,=fma sweep n256 g1 c1,=gemv mma n128 g1 s4,=gemv mma n128 g1 s8,=gemv mma n64 g1 s8" \
        --out "$out/ncu_probe"
        pkill -9 -f "gemv_probe.py --once" ;;  # ncu's target process outlives a killed ncu (session 4)
    # session 6: the tensor-core GEMV's code unpacking (join against the old broadcast) and its grid,
    # with occupancy limits and shared-memory traffic (kernel time, not harness time)
    ncu_unpack) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_unpack 280 ncu --clock-control none --kernel-name regex:'q4' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio \
        python3 benchmarks/gemv_probe.py --once --rows 1,8 --only "=gemv mma,=gemv mma bcast,mma join" \
        --out "$out/ncu_unpack_probe"
        pkill -9 -f "gemv_probe.py --once" ;;
    # session 6: the dequantize-first body (dq_kernel.py) at GEMV grids, and both bodies in the tiled
    # GEMM at 64 rows next to a bf16 dot (the same metrics)
    ncu_dq) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_dq 280 ncu --clock-control none --kernel-name regex:'q4|gemm|cutlass|nvjet|sm90' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio \
        python3 benchmarks/gemv_probe.py --once --rows 1,8,64 --only "=gemv mma,mma dq,qmm,bf16 dot" \
        --out "$out/ncu_dq_probe"
        pkill -9 -f "gemv_probe.py --once" ;;
    # the CUDA-core GEMV's launch shapes at 1, 4 and 8 rows (does any stay near 20 us at 8 rows?)
    fmasweep) step fmasweep 150 python3 benchmarks/gemv_probe.py --rows 1,8 \
        --only "=gemv mma,=gemv fma,fma sweep" --out "$out/fmasweep" ;;
    # one GEMV launch's device time next to stream kernels and an XLA reduction (docs/kernels.md)
    probe) step probe 75 python3 benchmarks/gemv_probe.py --rows 1,8 --trace gemv,stream,xla \
        --only "=gemv mma,=gemv fma,=xla sum(words),stream mma-grid st1,stream n16 g32 s1 w4" --out "$out/probe" ;;
    # the rows measured before: whole 12B decode and verify K = 4; the slice's K = 2..8 and padded
    # verify; batched scaling
    full) step full 80 $sb --no-assistant --runs forward --k-values 4 --time-budget 45 --out "$out/full" ;;
    # the whole 12B's decode forward with the CUDA-core GEMV at two launch shapes (session 5's sweep
    # candidates), next to the default in the same call (the `full` step)
    fwd_fma) JAXSPEC_GEMV_KERNEL=fma JAXSPEC_GEMV_BLOCK_N=256 JAXSPEC_GEMV_GROUPS_PER_STEP=1 JAXSPEC_GEMV_CHAINS=1 \
        step fwd_fma_n256c 80 $sb --no-assistant --runs forward --k-values 4 --time-budget 45 --out "$out/fwd_fma_n256c"
        JAXSPEC_GEMV_KERNEL=fma JAXSPEC_GEMV_BLOCK_N=128 JAXSPEC_GEMV_GROUPS_PER_STEP=1 \
        step fwd_fma_n128 80 $sb --no-assistant --runs forward --k-values 4 --time-budget 45 --out "$out/fwd_fma_n128" ;;
    # the whole 12B decode forward with the dequantize-first body, 2 groups per step (next to `full`)
    full_dq) JAXSPEC_DEQUANT=weights JAXSPEC_GEMV_GROUPS_PER_STEP=2 step full_dq 80 $sb --no-assistant --runs forward \
        --k-values 4 --time-budget 45 --out "$out/full_dq" ;;
    # session 6: the ncu of the paired unpack (and of a scale/bias prefetch, since removed); whole-12B forwards at
    # the GEMV grid of 64-row tiles split to ~1920 programs (the ncu's fastest join launch)
    ncu_pairs) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_pairs 200 ncu --clock-control none --kernel-name regex:'q4' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio \
        python3 benchmarks/gemv_probe.py --once --rows 1,8 --only "=gemv mma,mma pairs,=mma join n64 g1 s8 w4" \
        --out "$out/ncu_pairs_probe"
        pkill -9 -f "gemv_probe.py --once" ;;
    # the kpairs unpack against the pairs unpack, kernel alone (docs/kernels.md, log entry 8; the
    # dispatch's "gemv mma" runs kpairs now, so set JAXSPEC_GEMV_UNPACK=pairs for the old pair)
    ncu_kpairs) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_kpairs 200 ncu --clock-control none --kernel-name regex:'q4' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio \
        python3 benchmarks/gemv_probe.py --once --rows 1,8 --only "=gemv mma,mma kpairs n64 s8 st3" --out "$out/ncu_kpairs_probe"
        pkill -9 -f "gemv_probe.py --once" ;;
    # why 2 pipeline stages beat 3 in the whole model (log entry 9): residency (shared memory per
    # program, occupancy limits) or latency, kernel alone. Answered in entry 10: neither limits
    # residency (registers do); the kernel times tie
    ncu_stages) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_stages 200 ncu --clock-control none --kernel-name regex:'q4' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__occupancy_limit_warps,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio \
        python3 benchmarks/gemv_probe.py --once --rows 1,8 --only "=gemv mma,mma kpairs" --out "$out/ncu_stages_probe"
        pkill -9 -f "gemv_probe.py --once" ;;
    # session 9: the GEMV on "kn" weights (scales/biases [K/g, N], the default) against MLX's "nk" on
    # both MLP shapes, kernel alone, with the global-load requests and sectors (docs/kernels.md, log
    # entry 10; at b9cc3c2 this step also ran word tiles stored per group, since removed)
    ncu_layout) for shape in 15360x3840 3840x15360; do
        XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_layout_$shape 150 ncu --clock-control none --kernel-name regex:'q4' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__shared_mem_per_block_dynamic,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio \
        python3 benchmarks/gemv_probe.py --once --shape $shape --rows 1,8 --only "=gemv mma,mma nk" \
        --out "$out/ncu_layout_probe"
        pkill -9 -f "gemv_probe.py --once"
    done ;;
    # session 10: the GEMV around its default on "kn" weights, kernel alone: each group's sum(x) by
    # reduction, by a ones-MMA (since removed) or from the wrapper (Tiling.xsum), and wider tiles
    # (gemv_probe "kn ..."; log entry 11)
    ncu_kn) for shape in 15360x3840 3840x15360; do
        XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_kn_$shape 200 ncu --clock-control none --kernel-name regex:'q4' \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio \
        python3 benchmarks/gemv_probe.py --once --shape $shape --rows 1,8 --only "kn n" --out "$out/ncu_kn_probe"
        pkill -9 -f "gemv_probe.py --once"
    done ;;
    # the same variants' harness times (per op, the wrapper's x reorder, sums and split-K fold included)
    probe_kn) step probe_kn 200 python3 benchmarks/gemv_probe.py --rows 1,8 --only "=gemv mma,kn n" --out "$out/probe_kn" ;;
    # session 10: the Mosaic GPU kernel (pallas_kernels/mosaic_qmm.py, written after the device time ran
    # out): its GPU test, then harness times next to the Triton GEMV / qmm and the bf16 dot, then the
    # whole 12B forward with it (JAXSPEC_MOSAIC=1) against `full`
    mosaic) step mosaic_test 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k mosaic
        step mosaic_probe 150 python3 benchmarks/gemv_probe.py --rows 1,8 --only "=gemv mma,mosaic" \
            --out "$out/mosaic_probe"
        step mosaic_probe_qmm 150 python3 benchmarks/gemv_probe.py --rows 64,128 --only "=qmm default,mosaic,=bf16 dot" \
            --out "$out/mosaic_probe_qmm" ;;
    # session 11: the Mosaic kernel's launch options (benchmarks/mosaic_sweep.py), and ncu's view of its
    # launch (occupancy limits, registers, shared memory) next to the Triton GEMV at 1 and 8 rows
    mosaic_sweep) step mosaic_sweep 480 python3 benchmarks/mosaic_sweep.py --out "$out/mosaic_sweep" --deadline 430 ;;
    ncu_mosaic) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_mosaic 150 ncu --clock-control none --kernel-name regex:'q4' \
        --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__occupancy_limit_warps,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum \
        python3 benchmarks/gemv_probe.py --once --shape 15360x3840 --rows 1,8 --only "=gemv mma,mosaic" --out "$out/ncu_mosaic_probe"
        pkill -9 -f "gemv_probe.py --once" ;;
    # session 11 (written after the device time ran out): tile-major words (quant.word_tiles), kernel
    # alone under ncu (the copy made inside the op is not a 'q4'/'stream' kernel): stream kernels at
    # the GEMV's grids, row-major against tile-major, and the Mosaic kernel with and without tiles
    ncu_tiles) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_tiles 200 ncu --clock-control none --kernel-name regex:'q4|stream' \
        --metrics gpu__time_duration.sum,launch__grid_size,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
        python3 benchmarks/gemv_probe.py --once --shape 15360x3840 --rows 1 \
        --only "=gemv mma,stream tiles,=stream mma-grid st1,=stream n64 g8 s1 w4,=stream n128 g4 s4 w4,mosaic m16" \
        --out "$out/ncu_tiles_probe"
        pkill -9 -f "gemv_probe.py --once" ;;
    # session 12: the tensor-core GEMV on row-major and tile-major words (QuantizedWeight.w_layout)
    # at several launch shapes (gemv_probe.layout_variants; call 2 ran stages and a loaded-ahead group)
    ncu_layout12) for spec in 15360x3840:1,8 3840x15360:1; do shape=${spec%%:*}
        XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_layout12_$shape 170 ncu --clock-control none --kernel-name regex:'q4' \
            --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
            python3 benchmarks/gemv_probe.py --once --shape $shape --rows ${spec##*:} --only "=gemv mma,s12 " \
            --out "$out/ncu_layout12_probe_$shape"
        pkill -9 -f "gemv_probe.py --once"; done ;;
    # the CUDA-core GEMV on both layouts next to the tensor-core default (written after session 12's
    # device time ran out: unmeasured)
    ncu_fma_tiles) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_fma_tiles 150 ncu --clock-control none --kernel-name regex:'q4' \
            --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
            python3 benchmarks/gemv_probe.py --once --shape 15360x3840 --rows 1,8 \
            --only "=gemv mma,s12 rows fma,s12 tiles fma,=s12 tiles n64 s8 w4 st3 reduce" --out "$out/ncu_fma_tiles_probe"
        pkill -9 -f "gemv_probe.py --once" ;;
    # session 13: what the libraries take to read the same bytes (XLA reduce/copy; a bf16 GEMV of equal
    # bytes through PyTorch, i.e. cuBLAS), and cuBLAS's bf16 GEMM of the weight's own shape at qmm's
    # rows, kernel alone: the ceilings the qmv and qmm targets are set against. (XLA's dot autotunes
    # its first compile: ~1000 kernels under ncu, and the process crashed at its end in call 1.)
    ceiling) XLA_PYTHON_CLIENT_PREALLOCATE=false step ceiling_jax 100 ncu --clock-control none \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
            python3 benchmarks/read_ceiling.py --lib jax --shapes 15360x3840,262144x3840 --rows ""
        XLA_PYTHON_CLIENT_PREALLOCATE=false step ceiling_torch 100 ncu --clock-control none \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
            python3 benchmarks/read_ceiling.py --lib torch --shapes 15360x3840,262144x3840 --rows 1,8
        XLA_PYTHON_CLIENT_PREALLOCATE=false step ceiling_dense 100 ncu --clock-control none \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size \
            python3 benchmarks/read_ceiling.py --lib torch --dense --shapes 15360x3840,3840x15360 --rows 64,128,256,512
        pkill -9 -f "read_ceiling.py" ;;
    # session 13: the tied head's GEMV (262144x3840) around its unsplit default, and the tiled qmm on
    # tiles with smaller / more programs at 64-256 rows (gemv_probe gemv_sweep13, qmm_sweep13)
    ncu13) for spec in "262144x3840:1:=gemv mma,s13 gemv,s13 fma" "15360x3840:64,128,256:s13 qmm" \
                "3840x15360:128:s13 qmm"; do
        shape=${spec%%:*}; rest=${spec#*:}; rows=${rest%%:*}; only=${rest#*:}
        XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu13_$shape 200 ncu --clock-control none --kernel-name regex:'q4|stream' \
            --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum \
            python3 benchmarks/gemv_probe.py --once --shape $shape --rows $rows --only "$only" \
            --out "$out/ncu13_probe_$shape"
        pkill -9 -f "gemv_probe.py --once"; done ;;
    # session 13: the tied head's new default launch (tiling.TALL_N) next to the old one, kernel
    # alone at 1 and 8 rows; its GPU test; then the kernel table on tiles and the whole-12B forward
    final13) XLA_PYTHON_CLIENT_PREALLOCATE=false step ncu_head 150 ncu --clock-control none --kernel-name regex:'q4' \
            --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
            python3 benchmarks/gemv_probe.py --once --shape 262144x3840 --rows 1,8 --only "=gemv mma,=s13 gemv n64 s1 reduce" \
            --out "$out/ncu_head_probe"
        pkill -9 -f "gemv_probe.py --once"
        step pytest_head 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "tall_head or fused_launch"
        step kernel_table 260 python3 benchmarks/kernel_bench.py --phase table --shapes 15360x3840,3840x15360,262144x3840 \
            --table-rows 1,2,4,8,16,64,128,256 --deadline 230 --out "$out/kb" ;;
    # the whole 12B decode forward with models storing tiles (call 2 also ran a loaded-ahead next
    # group, since removed: 8.44 ms), and with 128-wide GEMV blocks on tiles
    full_tiles) JAXSPEC_W_LAYOUT=tiles step full_tiles 80 $sb --no-assistant --runs forward --k-values 4 \
            --time-budget 45 --out "$out/full_tiles" ;;
    full_tiles_n128) JAXSPEC_W_LAYOUT=tiles JAXSPEC_GEMV_BLOCK_N=128 step full_tiles_n128 80 $sb --no-assistant \
            --runs forward --k-values 4 --time-budget 45 --out "$out/full_tiles_n128" ;;
    full_rows) JAXSPEC_W_LAYOUT=rows step full_rows 80 $sb --no-assistant --runs forward --k-values 4 \
            --time-budget 45 --out "$out/full_rows" ;;
    full_mosaic) JAXSPEC_MOSAIC=1 step full_mosaic 80 $sb --no-assistant --runs forward --k-values 4 --time-budget 45 \
        --out "$out/full_mosaic" ;;
    # session 10: a 512-token prefill with the qmm dense fallback on (256) and off (0): compiled
    # temporaries for 2, 6 and 48 layers (abstract weights), then wall time on an 8-layer slice
    prefill_mem) step prefill_mem 200 python3 benchmarks/prefill_memory.py --layers 2,6,0 --tokens 512 \
            --dense-rows 256,0 --out "$out/prefill_mem"
        step prefill_time 150 python3 benchmarks/prefill_memory.py --layers 8 --tokens 512 --dense-rows 256,0 --time \
            --out "$out/prefill_time" ;;
    # the GEMV's previous default unpack, for the whole-model A/B against kpairs (log entry 8)
    full_pairs) JAXSPEC_GEMV_UNPACK=pairs step full_pairs 80 $sb --no-assistant --runs forward --k-values 4 \
        --time-budget 45 --out "$out/full_pairs" ;;
    # q/k/v and gate/up as one launch per weight (the default before log entry 9), against `full`
    full_unfused) JAXSPEC_FUSED_LAUNCH=0 step full_unfused 80 $sb --no-assistant --runs forward --k-values 4 \
        --time-budget 45 --out "$out/full_unfused" ;;
    # the GEMV at 2 pipeline stages (the default in log entry 9, 3 again since entry 10), against `full`
    full_st2) JAXSPEC_GEMV_STAGES=2 step full_st2 80 $sb --no-assistant --runs forward --k-values 4 \
        --time-budget 45 --out "$out/full_st2" ;;
    # session 10: the GEMV's sum(x) from the wrapper (Tiling.xsum="input") and 128-column tiles (split
    # to ~1920 programs), each and both, against `full` (ncu_kn: -1 us at best for the sums, -1..2 us for the tiles, kernel alone)
    full_xs) JAXSPEC_GEMV_XSUM=input step full_xsum_input 80 $sb --no-assistant --runs forward --k-values 4 \
        --time-budget 45 --out "$out/full_xsum_input"
        JAXSPEC_GEMV_BLOCK_N=128 step full_n128 80 $sb --no-assistant --runs forward --k-values 4 \
        --time-budget 45 --out "$out/full_n128"
        JAXSPEC_GEMV_BLOCK_N=128 JAXSPEC_GEMV_XSUM=input step full_n128_input 80 $sb --no-assistant --runs forward \
        --k-values 4 --time-budget 45 --out "$out/full_n128_input" ;;
    # session 9: weights stored with MLX's scale layout ([N, K/g]) instead of "kn", against `full`
    full_nk) JAXSPEC_SB_LAYOUT=nk step full_nk 80 $sb --no-assistant --runs forward --k-values 4 \
        --time-budget 45 --out "$out/full_nk" ;;
    full_n64) JAXSPEC_GEMV_BLOCK_N=64 JAXSPEC_GEMV_TARGET_PROGRAMS=1920 step full_n64 80 $sb --no-assistant \
        --runs forward --k-values 4 --time-budget 45 --out "$out/full_n64" ;;
    full_n64_960) JAXSPEC_GEMV_BLOCK_N=64 JAXSPEC_GEMV_TARGET_PROGRAMS=960 step full_n64_960 80 $sb --no-assistant \
        --runs forward --k-values 4 --time-budget 45 --out "$out/full_n64_960" ;;
    full_n128_960) JAXSPEC_GEMV_TARGET_PROGRAMS=960 step full_n128_960 80 $sb --no-assistant \
        --runs forward --k-values 4 --time-budget 45 --out "$out/full_n128_960" ;;
    # the tiled GEMM's two bodies at 64 rows next to a bf16 dot, and the GEMV default (harness times)
    probe64) step probe64 120 python3 benchmarks/gemv_probe.py --rows 1,8,64 --only "=gemv mma,qmm,bf16 dot" \
        --out "$out/probe64" ;;
    # the GPU-only kernel tests (Triton-compiled kernels, row invariance at real shapes; 30 tests since
    # session 11: 250 s ran 21 of them)
    pytest_gpu) step pytest_gpu 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py ;;
    fwd) step fwd 60 $slice --runs forward --k-values 2,4,8 --pad-k-values 4 --verify-pad on --qmm-tile-m 64 \
        --time-budget 40 --out "$out/fwd" ;;
    scaling) step scaling 30 $slice --no-assistant --runs scaling --scaling-batch 1,8,32 --max-tokens 32 \
        --time-budget 20 --out "$out/scaling" ;;
    *) echo "unknown step $s" ;;
    esac
done
