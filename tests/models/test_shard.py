"""models.shard (issue 27) on host devices: each run is a subprocess started with N CPU devices
(`--xla_force_host_platform_device_count`, set before JAX starts), float32. On the mesh: the weights
and the KV cache are split as documented, the forward runs per shard (all-reduces, no gathers) on the
XLA backend and on the Pallas kernels (interpret mode: the slow tier), the logits match the unsharded model's, a
K-wide verify equals K decode steps bitwise, and greedy speculative decoding equals classic decoding
(and the unsharded model's tokens), also with the programs loaded back from jaxspec's disk cache."""
import json
import os
import subprocess
import sys

import pytest

from support.hostenv import host_devices_env
from support.seeds import seeded_rng

from support.paths import REPO  # noqa: E402

SCRIPT = r'''
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
import jaxspec
from jaxspec import models
from jaxspec.models import presets
from jaxspec.kernels import DispatchConfig

g = jax.device_count()
xla = DispatchConfig(backend="xla")
# the 12B's layout in small: sliding layers with 2 KV heads, global ones with 1 (k = v)
td = presets.tiny_target_dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64,
                              global_head_dim=64, num_key_value_heads=2, vocab_size=512, attention_k_eq_v=True)
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
q = ts.params["scan.1.self_attn.q_proj"].weight
out["q_shard_rows"] = [s.data.shape[1] for s in q.addressable_shards]
collectives = lambda m, *a: {k: jax.jit(models.forward).lower(m, *a).compile().as_text().count(k + "(")
                             for k in ("all-reduce", "all-gather", "all-to-all", "reduce-scatter")}
rng = np.random.default_rng(seed)
tokens = jnp.asarray(rng.integers(3, 512, (2, 12)), jnp.int32)
cache = models.init_cache(tcfg, 2, 64, jnp.float32)
fwd = jax.jit(models.forward)
ref, _, _ = fwd(t, tokens, cache)
got, _, c = fwd(ts, tokens, cache)
out["max_abs_diff"] = float(jnp.max(jnp.abs(got - ref)))
out["max_abs_logit"] = float(jnp.max(jnp.abs(ref)))
out["cache_specs"] = [spec(x) + [None] * (x.ndim - len(x.sharding.spec)) for x in c.k]
out["collectives"] = collectives(ts, tokens, cache)
if sys.argv[2] == "pallas":  # the kernels, per shard (interpret mode: the slow tier's)
    pal = DispatchConfig(backend="pallas", interpret=True)
    tp_, tsp = t.replace(matmul=pal), models.shard(t.replace(matmul=pal), mesh)
    refp = fwd(tp_, tokens, cache)[0]
    out["pallas_max_abs_diff"] = float(jnp.max(jnp.abs(fwd(tsp, tokens, cache)[0] - refp)))
    out["pallas_collectives"] = collectives(tsp, tokens, cache)
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
if g == 2:  # the loop's other cases, on one mesh
    ocfg = models.AssistantConfig.from_dict(presets.tiny_assistant_dict(td, use_ordered_embeddings=True))
    ordered = presets.random_model(ocfg, jax.random.key(seed + 2), dtype=jnp.float32, matmul=xla)  # centroid head
    out["ordered_equals_classic"] = jaxspec.generate(ts, ids, assistant=models.shard(ordered, mesh), block_size=4,
                                                     **kw).tokens == classic.tokens
    try:
        models.draft_step(a, ts, c, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 256), jnp.float32), c.lengths)
    except ValueError as e:
        out["mixed_error"] = str(e)
    from jaxspec.engine import programs
    programs._MEMO.clear()  # the same calls again, their programs now read back from the disk cache
    out["reloaded_equal"] = [jaxspec.generate(ts, ids, assistant=as_, block_size=4, **kw).tokens == spec_.tokens,
                             jaxspec.generate(t, ids, block_size=1, **kw).tokens == alone.tokens]
print("RESULT " + json.dumps(out))
'''


def run_on(devices: int, seed: int, cache_dir, pallas: bool = True) -> dict:
    env = host_devices_env(devices, PYTHONPATH=REPO, JAX_COMPILATION_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(seed), "pallas" if pallas else "xla"], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


# The fast tier runs the XLA path on 2 devices; the Pallas kernels per shard (interpret mode, most of
# the run's time) and the 4-device mesh are the slow tier's.
@pytest.mark.parametrize("devices, pallas", [(2, False), pytest.param(2, True, marks=pytest.mark.slow),
                                             pytest.param(4, True, marks=pytest.mark.slow)])
def test_sharded_model_matches_on_the_mesh(devices, pallas, tmp_path):
    r = run_on(devices, seed=devices, cache_dir=tmp_path, pallas=pallas)
    assert r["devices"] == devices
    specs = r["specs"]
    # column-parallel: the row tiles and the scales' columns; row-parallel: the groups and the scales' rows
    col, row = [None, "tp", None, None, None, "|", None, None, "tp"], [None, None, "tp", None, None, "|", None, "tp", None]
    rep = [None] * 5 + ["|"] + [None] * 3
    assert specs["scan.0.mlp.gate_proj"] == col and specs["scan.0.mlp.down_proj"] == row
    assert specs["embed_tokens"][0] == "tp"
    # sliding layers: 2 KV heads split on 2 devices with their queries; on 4 the whole block stays whole
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        want = rep if devices == 4 else row if name == "o_proj" else col
        assert specs[f"scan.0.self_attn.{name}"] == want, name
    # global layers: one KV head (k = v), replicated; the 4 query heads split over 2 or 4 devices
    assert specs["scan.1.self_attn.k_proj"] == rep and "scan.1.self_attn.v_proj" not in specs
    assert specs["scan.1.self_attn.q_proj"] == col and specs["scan.1.self_attn.o_proj"] == row
    assert r["q_shard_rows"] == [4 // devices] * devices  # 256 rows = 4 tiles, a 1/G share each
    # the KV cache ([L, B, C, heads, D] stacks) follows: split by KV heads exactly where k/v are
    assert r["cache_specs"] == [[None, None, None, "tp" if devices == 2 else None, None], [None] * 5]
    # per shard: one all-reduce per split row-parallel projection of the scan body (o and down of 2
    # layers; the sliding o is whole on 4 devices) and one for the vocabulary-split embedding lookup,
    # no gathers, on the XLA path and on the Pallas kernels
    reduces = 5 if devices == 2 else 4
    for key in ("collectives", "pallas_collectives") if pallas else ("collectives",):
        assert r[key] == {"all-reduce": reduces, "all-gather": 0, "all-to-all": 0, "reduce-scatter": 0}, (key, r[key])
    # float32: the row-parallel sums add in another order; measured ~1.8e-5 at |logits| up to ~9
    assert r["max_abs_diff"] <= 5e-5 and r["max_abs_logit"] > 1.0, r
    assert not pallas or r["pallas_max_abs_diff"] <= 5e-5, r
    if devices == 2:
        assert r["reloaded_equal"] == [True, True] and r["ordered_equals_classic"]
        assert "must be sharded alike" in r["mixed_error"]
    assert r["verify_bitwise"]
    assert r["mode"] == "speculative" and r["fallback"] is None
    assert r["spec_equals_classic"] and r["classic_equals_unsharded"]
    assert f"holds {devices // 2} of this process's {devices} devices" in r["partial_mesh_error"]


def test_shard_refuses_a_missing_axis():
    import jax
    import numpy as np

    from jaxspec import models
    from jaxspec.models import presets

    t = presets.random_model(models.TargetConfig.from_dict(presets.tiny_target_dict()), jax.random.key(0))
    with pytest.raises(ValueError, match="no axis 'tp'"):
        models.shard(t, jax.sharding.Mesh(np.array(jax.devices()), ("x",)))
    assert models.shard(t, jax.sharding.Mesh(np.array(jax.devices()), ("tp",))).config == t.config


@pytest.mark.slow
def test_cli_devices_splits_the_default_pair():
    """`jaxspec generate --devices 2` on two host devices prints the tokens of the unsplit pair (float32:
    in bf16 the split sums' other order may flip a near-tie), identical to classic decoding on the
    mesh, and a count other than the process's is refused before loading."""
    from jaxspec import default_pair as dp
    if not dp.default_pair_available():
        pytest.skip("default pair not installed")
    env = host_devices_env(2)
    cli = [sys.executable, "-m", "jaxspec.cli", "generate", "def flatten(items):", "--max-tokens", "16",
           "--backend", "xla", "--json", "--no-compile-cache", "--dtype", "float32"]
    runs = {}
    for n in (1, 2):
        r = subprocess.run(cli + ["--devices", str(n)] + (["--compare"] if n == 2 else []), env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[n] = json.loads(r.stdout)
        assert ("split over 2 devices" in r.stderr) == (n == 2)
    assert runs[2]["tokens"] == runs[1]["tokens"] and runs[2]["stats"]["mode"] == "speculative"
    assert runs[2]["identical_to_classic"]
    r = subprocess.run(cli + ["--devices", "3"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "this process has 2 devices" in r.stderr and "loading" not in r.stderr


@pytest.mark.gpu
def test_sharded_kernels_on_several_gpus():
    """On a machine with 2+ GPUs: the compiled Pallas kernels run per shard (no all-gather in the
    program), the logits match the unsharded model's to bf16 rounding, and greedy speculative
    decoding equals classic decoding on the mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxspec
    from jaxspec import models
    from jaxspec.models import presets

    if jax.device_count() < 2:
        pytest.skip("needs 2 or more GPUs")
    td = presets.tiny_target_dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, head_dim=64,
                                  global_head_dim=128, num_key_value_heads=4, vocab_size=1024, attention_k_eq_v=True)
    tcfg = models.TargetConfig.from_dict(td)
    t = presets.random_model(tcfg, jax.random.key(0), dtype=jnp.bfloat16)
    a = presets.random_model(models.AssistantConfig.from_dict(presets.tiny_assistant_dict(td)), jax.random.key(1),
                             dtype=jnp.bfloat16)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
    ts, as_ = models.shard(t, mesh), models.shard(a, mesh)
    rng = seeded_rng()
    tokens = jnp.asarray(rng.integers(3, 1024, (2, 12)), jnp.int32)
    cache = models.init_cache(tcfg, 2, 64, jnp.bfloat16)
    fwd = jax.jit(models.forward)
    ref, got = fwd(t, tokens, cache)[0], fwd(ts, tokens, cache)[0]
    assert float(jnp.max(jnp.abs(got - ref))) <= 0.05 * float(jnp.max(jnp.abs(ref)))
    assert "all-gather" not in fwd.lower(ts, tokens, cache).compile().as_text()
    ids = rng.integers(3, 1024, 10).tolist()
    kw = dict(max_new_tokens=24, eos_token_ids=[])
    classic = jaxspec.generate(ts, ids, block_size=1, **kw)
    spec = jaxspec.generate(ts, ids, assistant=as_, block_size=4, **kw)
    assert spec.stats.mode == "speculative" and spec.tokens == classic.tokens
