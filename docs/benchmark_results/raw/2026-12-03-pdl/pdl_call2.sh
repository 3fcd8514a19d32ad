export PYTHONPATH=$PWD
mkdir -p /tmp/r
bench() { local tag=$1; shift; s=$(date +%s); XLA_FLAGS="$*" timeout 150 python3 benchmarks/speculative_bench.py --target 12b --no-assistant --runs loop --max-tokens 32 --commit 962fe6d --out /tmp/b-$tag > /tmp/r/b-$tag.log 2>&1; echo "$tag rc=$? $(( $(date +%s)-s ))s $(grep "classic B" /tmp/r/b-$tag.log)"; }
bench default1
bench pdl_on --xla_gpu_enable_pdl=true
bench pdl_launch_on --xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true
bench pdl_off --xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false
bench default2
bench pdl_launch_on2 --xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true
for t in "default:" "pdl_both:--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" "pdl_off:--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false"; do
  tag=${t%%:*}; fl=${t#*:}; OUT=/tmp/r SETS=16 XLA_FLAGS="$fl" timeout 120 python3 .probe/pdl_chain.py chain16-$tag 2>&1 | grep '^{' 
done
tar czf $OUT/call2.tgz -C /tmp/r . ; ls $OUT
