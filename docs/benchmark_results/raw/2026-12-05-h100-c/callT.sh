# the trimmed heads on the GPU: after .gguf/q0..q3 went to /tmp/gg; carry the shipped drafter's model.safetensors
set -o pipefail
cat /tmp/gg/q0 /tmp/gg/q1 /tmp/gg/q2 /tmp/gg/q3 > /tmp/g.gguf || exit 3
echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  /tmp/g.gguf" | sha256sum -c || exit 4
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/gpu.txt
export PYTHONUNBUFFERED=1
for n in ${HEADS:-0 16384}; do
  timeout ${T:-110} python3 benchmarks/drafter_heldout_bench.py --target /tmp/g.gguf --draft-vocab $n --out $OUT/heldout_$n.json > $OUT/heldout_$n.log 2>&1
  echo "rc $?"; grep -v Warn $OUT/heldout_$n.log | tail -2 | cut -c1-400
done
