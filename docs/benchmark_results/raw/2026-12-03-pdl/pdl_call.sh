set -x
python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__)"
P=$(python3 -c "import jax_plugins; print(list(jax_plugins.__path__)[0])")
echo plugin $P; SOS=$(find $P -name "*.so"); echo $SOS
python3 - $SOS > $OUT/pdl_flags.txt <<'PY'
import re, sys
found=set(); n=0
for fn in sys.argv[1:]:
    b=open(fn,'rb').read()
    n+=b.count(b'griddepcontrol')
    found.update(m.decode() for m in re.findall(rb'xla_gpu[a-z0-9_]*(?:pdl|dependent|griddep)[a-z0-9_]*', b, re.I))
print('\n'.join(sorted(found))); print('griddepcontrol_count', n, file=sys.stderr)
PY
cat $OUT/pdl_flags.txt
export PYTHONPATH=$PWD
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/jax_triton*.whl 2>&1 | tail -1
PYTHONPATH=$PWD:/tmp/site python3 -c "import jax_triton as jt; print('jax_triton', jt.__version__)" 2>&1 | tail -2
python3 .probe/pdl_chain.py default 2>&1 | grep -v Warning | tail -5
for f in $(cat $OUT/pdl_flags.txt | grep -o -E "xla_gpu[a-z_]*pdl[a-z_]*" | sort -u | head -3); do
  XLA_FLAGS="--$f=false" python3 .probe/pdl_chain.py ${f}_false 2>&1 | tail -4
  XLA_FLAGS="--$f=true" python3 .probe/pdl_chain.py ${f}_true 2>&1 | tail -4
done
XLA_FLAGS="--xla_gpu_enable_command_buffer=" python3 .probe/pdl_chain.py nocmdbuf 2>&1 | tail -4
