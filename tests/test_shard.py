"""models.shard (issue 27) on host devices: each run is a subprocess started with N CPU devices
(`--xla_force_host_platform_device_count`, set before JAX starts), on the XLA matmul backend, float32.
On the mesh: the weights are split as documented, the logits match the unsharded model's, a K-wide
verify equals K decode steps bitwise, and greedy speculative decoding equals classic decoding (and
the unsharded model's tokens)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import jaxspec, models
from models import presets
from pallas_kernels import DispatchConfig

g = jax.device_count()
xla = DispatchConfig(backend="xla")
td = presets.tiny_target_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64,
                              global_head_dim=64, num_key_value_heads=2, vocab_size=512)
tcfg = models.TargetConfig.from_dict(td)
acfg = models.AssistantConfig.from_dict(presets.tiny_assistant_dict(td))
seed = int(sys.argv[1])
t = presets.random_model(tcfg, jax.random.key(seed), dtype=jnp.float32, matmul=xla)
a = presets.random_model(acfg, jax.random.key(seed + 1), dtype=jnp.float32, matmul=xla)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
ts, as_ = models.shard(t, mesh), models.shard(a, mesh)
out = {"devices": g}
try:
    models.shard(t, jax.sharding.Mesh(np.array(jax.devices()[:g // 2]), ("tp",)))
except ValueError as e:
    out["partial_mesh_error"] = str(e)
spec = lambda x: [None if s is None else str(s) for s in x.sharding.spec]
out["specs"] = {n: spec(w.weight) + ["|"] + spec(w.scales) for n, w in ts.params.items() if hasattr(w, "weight")}
q = ts.params["scan.0.self_attn.q_proj"].weight
out["q_shard_rows"] = [s.data.shape[1] for s in q.addressable_shards]
rng = np.random.default_rng(seed)
tokens = jnp.asarray(rng.integers(3, 512, (2, 12)), jnp.int32)
cache = models.init_cache(tcfg, 2, 64, jnp.float32)
fwd = jax.jit(models.forward)
ref, _, _ = fwd(t, tokens, cache)
got, _, c = fwd(ts, tokens, cache)
out["max_abs_diff"] = float(jnp.max(jnp.abs(got - ref)))
out["max_abs_logit"] = float(jnp.max(jnp.abs(ref)))
block = jnp.asarray(rng.integers(3, 512, (2, 4)), jnp.int32)
wide, _, _ = fwd(ts, block, c)
steps, cc = [], c
for i in range(4):
    lg, _, cc = fwd(ts, block[:, i:i + 1], cc)
    steps.append(lg)
out["verify_bitwise"] = bool(jnp.array_equal(wide, jnp.concatenate(steps, axis=1)))
ids = rng.integers(3, 512, 10).tolist()
kw = dict(max_new_tokens=20, eos_token_ids=[])
classic = jaxspec.generate(ts, ids, block_size=1, **kw)
spec_ = jaxspec.generate(ts, ids, assistant=as_, block_size=4, **kw)
alone = jaxspec.generate(t, ids, block_size=1, **kw)
out.update(spec_equals_classic=spec_.tokens == classic.tokens, classic_equals_unsharded=classic.tokens == alone.tokens,
           mode=spec_.stats.mode, fallback=spec_.stats.fallback, rounds=spec_.stats.rounds)
print("RESULT " + json.dumps(out))
'''


def run_on(devices: int, seed: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(seed)], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("devices", [2, 4])
def test_sharded_model_matches_on_the_mesh(devices):
    r = run_on(devices, seed=devices)
    assert r["devices"] == devices
    specs = r["specs"]
    # column-parallel: the row tiles and the scales' columns; row-parallel: the groups and the scales' rows
    assert specs["scan.0.self_attn.q_proj"] == [None, "tp", None, None, None, "|", None, None, "tp"]
    assert specs["scan.0.mlp.gate_proj"][1] == "tp" and specs["scan.0.self_attn.o_proj"][2] == "tp"
    assert specs["scan.0.mlp.down_proj"][-2] == "tp" and specs["embed_tokens"][0] == "tp"
    # k/v: 2 KV heads x 64 = 128 rows, two tiles: split on 2 devices, replicated on 4
    kv = specs["scan.0.self_attn.k_proj"]
    assert kv[1] == ("tp" if devices == 2 else None)
    assert r["q_shard_rows"] == [4 // devices] * devices  # 256 rows = 4 tiles, a 1/G share each
    # float32: the row-parallel sums add in another order; measured ~1.6e-5 at |logits| up to ~30
    assert r["max_abs_diff"] <= 5e-5 and r["max_abs_logit"] > 1.0, r
    assert r["verify_bitwise"]
    assert r["mode"] == "speculative" and r["fallback"] is None
    assert r["spec_equals_classic"] and r["classic_equals_unsharded"]
    assert f"holds {devices // 2} of this process's {devices} devices" in r["partial_mesh_error"]


def test_shard_refuses_a_missing_axis():
    import jax
    import numpy as np

    import models
    from models import presets

    t = presets.random_model(models.TargetConfig.from_dict(presets.tiny_target_dict()), jax.random.key(0))
    with pytest.raises(ValueError, match="no axis 'tp'"):
        models.shard(t, jax.sharding.Mesh(np.array(jax.devices()), ("x",)))
    assert models.shard(t, jax.sharding.Mesh(np.array(jax.devices()), ("tp",))).config == t.config


def test_cli_devices_splits_the_default_pair():
    """`jaxspec generate --devices 2` on two host devices prints the tokens of the unsplit pair, and a
    count other than the process's is refused before loading."""
    from jaxspec import default_pair as dp
    if not dp.default_pair_available():
        pytest.skip("default pair not installed")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cli = [sys.executable, "-m", "jaxspec.cli", "generate", "def flatten(items):", "--max-tokens", "16",
           "--backend", "xla", "--json", "--no-compile-cache"]
    runs = {}
    for n in (1, 2):
        r = subprocess.run(cli + ["--devices", str(n)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[n] = json.loads(r.stdout)
        assert ("split over 2 devices" in r.stderr) == (n == 2)
    assert runs[2]["tokens"] == runs[1]["tokens"] and runs[2]["stats"]["mode"] == "speculative"
    r = subprocess.run(cli + ["--devices", "3"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "this process has 2 devices" in r.stderr and "loading" not in r.stderr
