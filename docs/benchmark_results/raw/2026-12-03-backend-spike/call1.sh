export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .probe/whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax; print(jax.__version__, jax.devices())"
s=$(date +%s); timeout 330 python3 .probe/spike42.py default > $OUT/spike-default.log 2>&1; echo "spike default rc=$? $(( $(date +%s)-s ))s"
grep '^{' $OUT/spike-default.log | cut -c1-400
grep -m3 -i "error\|Traceback" $OUT/spike-default.log | cut -c1-300
s=$(date +%s); XLA_FLAGS=--xla_gpu_enable_pdl_launch=true timeout 120 python3 .probe/spike42.py pdl_launch --quick > $OUT/spike-pdl.log 2>&1; echo "spike pdl_launch rc=$? $(( $(date +%s)-s ))s"
grep '^{"event": "time' $OUT/spike-pdl.log | cut -c1-300
