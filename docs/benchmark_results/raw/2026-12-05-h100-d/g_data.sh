# drafter chain, data call (after .gguf/q0..q2 went to /tmp/gg): reassemble the Gemma 3 270M GGUF, check it, run the data stage (MIN minutes)
set -o pipefail
cp .gguf/q3 /tmp/gg/ || exit 3
cat /tmp/gg/q0 /tmp/gg/q1 /tmp/gg/q2 /tmp/gg/q3 > /tmp/gemma-3-270m-q4_k_m.gguf && rm -rf /tmp/gg
echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  /tmp/gemma-3-270m-q4_k_m.gguf" | sha256sum -c || exit 4
nvidia-smi --query-gpu=name,driver_version --format=csv
export PYTHONUNBUFFERED=1 TARGET=/tmp/gemma-3-270m-q4_k_m.gguf PYTHON=python3
bash benchmarks/drafter_ttt_h200.sh data --minutes ${MIN:-8} $EXTRA
