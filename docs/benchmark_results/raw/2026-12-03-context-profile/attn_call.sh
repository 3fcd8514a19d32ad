export PYTHONPATH=$PWD
timeout 200 python3 .probe/attn_insitu.py 2>&1 | grep -v -i warn | tail -12
for fl in "" "--xla_gpu_enable_pdl=false"; do
  XLA_FLAGS="$fl" timeout 150 python3 benchmarks/profile_forward.py --target 12b --context 131072 --steps 4 --out /tmp/pp > /tmp/pp.log 2>&1
  echo "profile 131072 flags=[$fl] rc=$?"; grep "^Wall per" /tmp/pp/profile.md; grep "decode_attention\|MemcpyD2D" /tmp/pp/profile.md
done
