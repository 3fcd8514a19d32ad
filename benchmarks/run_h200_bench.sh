#!/usr/bin/env bash
# The recorded H200 runs behind README.md's benchmark table, as named steps that each fit one
# device call (< 10 min). Usage (from the repository root):
#   [COMMIT=<sha>] bash benchmarks/run_h200_bench.sh DEST [STEP ...]   (writes DEST/results.tgz, DEST/STEP.log)
# COMMIT names the code in the reports where the tree has no .git (else `git rev-parse`).
# Steps (default: all, in this order; about 1,800 s of step timeouts, so name a subset per call):
#   gpu_kernels   GPU tests, group 1: the matmul and attention kernels (tests/kernels, -m gpu)
#   gpu_models    GPU tests, group 2: the batch engine, the default backend, tensor parallel and Gemma 3 on the
#                 real kernels (named files: a folder's other modules may import packages the device lacks)
#   gpu_stream    GPU tests, group 3: the layer-stream spike (tests/bench, -m gpu)
#   (each fits one device call: 2026-12-04, gpu_models' files 175 s + 53 s; a new gpu test in tests/engine
#   or tests/models is added to gpu_models' list, one in tests/kernels or tests/bench joins by its folder)
#   kernels       kernel_bench: GPU correctness checks and the table of the default paths
#   decode12b     Gemma 4 12B shapes, random 4-bit weights: classic decode and a K = 4 round
#   default_pair  the shipped pair on its 20 held-out prompts x 64 tokens: acceptance and speedup
#   profile       where a 12B decode forward's time goes, by kernel
#   attention     attention_bench: the attention kernels against XLA's at the 12B's layer shapes
#   paged         attention_bench --ops paged: paged_attention against the gather path, 32 slots x 4,096
#   context       the 12B against context (128 .. 32K; a 131,072-token prompt needs a call of its own)
# Each step has a hard timeout and, where the tool has one, a softer deadline. Results are re-packed
# after every step, so a call cut short still returns what finished.
set -u
dest=${1:-out}
shift || true
steps=${*:-gpu_kernels gpu_models gpu_stream kernels decode12b default_pair profile attention paged context}
out=$(mktemp -d)
mkdir -p "$dest"
export PYTHONUNBUFFERED=1
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
sb="python3 benchmarks/speculative_bench.py --commit $commit"
step() {  # name timeout command...: run, log, re-pack
    local name=$1 t=$2; shift 2
    timeout "$t" "$@" > "$out/$name.log" 2>&1
    echo "== $name (rc $?)"
    grep -v Warning "$out/$name.log" | tail -n 25 | cut -c1-300
    cp "$out/$name.log" "$dest/" 2>/dev/null
    tar czf "$dest/results.tgz" -C "$out" .
}
for s in $steps; do
    case $s in
    gpu_kernels) step gpu_kernels 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels ;;
    gpu_models) step gpu_models 560 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_batching_gpu.py \
        tests/engine/test_default_backend.py tests/models/test_shard.py \
        && python3 -m pytest -q -p no:cacheprovider tests/models/test_gemma3_family.py" ;;
    gpu_stream) step gpu_stream 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests/bench ;;
    # the rows of docs/kernels.md's table: the two MLP shapes and the tied head
    kernels) step kernels 380 python3 benchmarks/kernel_bench.py --commit "$commit" --phase check,table \
        --shapes 15360x3840,3840x15360,262144x3840 --table-rows 1,2,4,8,16,64,128,256 --deadline 330 \
        --out "$out/kernels" ;;
    # building the 12B and compiling both loops takes most of the time: a call of its own
    decode12b) step decode12b 560 $sb --target 12b --assistant 12b --runs loop --k-values 4 --max-tokens 32 \
        --time-budget 500 --out "$out/decode12b" ;;
    default_pair) step default_pair 300 $sb --target default --runs loop --k-values 4 --max-tokens 64 \
        --each-prompt --time-budget 250 --out "$out/default_pair" ;;
    profile) step profile 150 python3 benchmarks/profile_forward.py --commit "$commit" --target 12b --steps 4 \
        --out "$out/profile" ;;
    attention) step attention 300 python3 benchmarks/attention_bench.py --commit "$commit" --out "$out/attention" ;;
    paged) step paged 300 python3 benchmarks/attention_bench.py --commit "$commit" --ops paged --out "$out/paged" ;;
    context) step context 580 python3 benchmarks/context_bench.py --commit "$commit" --target 12b --assistant 12b \
        --context 128,2048,8192,32768 --spec-context 128,32768 --max-tokens 32 --repeats 1 --time-budget 480 \
        --out "$out/context" ;;
    *) echo "unknown step $s (steps: gpu_kernels gpu_models gpu_stream kernels decode12b default_pair profile attention paged context)" ;;
    esac
done
