"""What a prefill costs with the qmm path's dense fallback on and off: compiled temporary memory
(XLA's own buffer assignment) and, on a GPU, the median wall time of one prefill forward.

The fallback (DispatchConfig.qmm_dense_rows) dequantizes each weight to bf16 and runs XLA's dot.
Dequantizing depends on the weight alone, so XLA kept several layers' transient bf16 weights alive
at once: on the H200 a 512-token prefill of the whole 12B had 7.64 GB of temporaries against 0.08
with the fallback off (docs/kernels.md, log entry 12). Since then the fallback's dequantization
depends on its input (pallas_kernels.xla.dense_after_x): compiled for CPU, the 6-layer slice went
from 3.84 to 1.62 GB, and on the H200 the whole 12B to 0.27 GB, as 2 layers (log entry 13).

    python benchmarks/prefill_memory.py --target 12b --layers 2,6,48 --tokens 512 [--time] --out DIR

Parameters are abstract (never allocated) unless --time is given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from harness import environment, median_time  # noqa: E402
from models.checkpoint import target_shapes  # noqa: E402
from models.presets import random_params  # noqa: E402
from pallas_kernels import DispatchConfig  # noqa: E402
from speculative_bench import truncate_layers  # noqa: E402

Q4 = {"bits": 4, "group_size": 64}


def prefill(target, tokens, cache):
    return models.target.forward(target, tokens, cache, logits_at=jnp.zeros((tokens.shape[0],), jnp.int32))[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="12b")
    ap.add_argument("--layers", default="2,6", help="comma-separated layer counts (0: all)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dense-rows", default="256,0", help="qmm_dense_rows values to compare (0: tiled kernel)")
    ap.add_argument("--time", action="store_true", help="also build random weights and time the prefill")
    ap.add_argument("--out", default="out_prefill")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    env = environment()
    rec = open(os.path.join(a.out, "prefill_memory.jsonl"), "w")
    for layers in map(int, a.layers.split(",")):
        tdict = models.presets.TARGETS[a.target]
        cfg = models.TargetConfig.from_dict(truncate_layers(tdict, layers) if layers else tdict)
        shapes = target_shapes(cfg)
        if a.time:
            params = random_params(shapes, jax.random.key(0), quantize=Q4)
        else:
            params = jax.eval_shape(lambda k: random_params(shapes, k, quantize=Q4), jax.random.key(0))
        tokens = jax.ShapeDtypeStruct((1, a.tokens), jnp.int32)
        cache = jax.eval_shape(lambda: models.cache.init_cache(cfg, 1, a.tokens + 64))
        for dense in map(int, a.dense_rows.split(",")):
            target = models.target.Target(config=cfg, params=params, matmul=DispatchConfig(qmm_dense_rows=dense))
            compiled = jax.jit(prefill).lower(target, tokens, cache).compile()
            mem = compiled.memory_analysis()
            line = {"layers": cfg.num_hidden_layers, "tokens": a.tokens, "qmm_dense_rows": dense,
                    "temp_gb": mem.temp_size_in_bytes / 1e9, "args_gb": mem.argument_size_in_bytes / 1e9, **env}
            if a.time:
                toks = jnp.ones((1, a.tokens), jnp.int32)
                real_cache = models.cache.init_cache(cfg, 1, a.tokens + 64)
                line["ms"] = median_time(compiled, target, toks, real_cache) * 1e3
            print(f"layers {line['layers']:3d} tokens {a.tokens} dense_rows {dense:4d}: temp {line['temp_gb']:.2f} GB, "
                  f"args {line['args_gb']:.2f} GB" + (f", {line['ms']:.1f} ms" if "ms" in line else ""), flush=True)
            rec.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
