"""benchmarks/read_ceiling.py: its inputs have exactly a 4-bit g64 weight's bytes, and its JAX ops run
(on the GPU they run under ncu; here on the CPU backend)."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import read_ceiling  # noqa: E402


def test_inputs_have_the_quantized_weights_bytes():
    n, k = 192, 640
    words, sb, eq_rows = read_ceiling.arrays(n, k, seed=int(np.random.default_rng().integers(1000)))
    assert words.shape == (n, k // 8) and words.dtype == np.uint32
    assert words.nbytes + sb.nbytes == n * k // 2 + 2 * 2 * n * (k // 64)
    assert eq_rows == (words.nbytes + sb.nbytes) // (2 * k)  # bf16 rows of K with the same bytes
    assert len(np.unique(words)) > words.size // 2  # random words, not a constant


def test_jax_ops_run(capsys):
    read_ceiling.main(["--lib", "jax", "--shapes", "64x128", "--rows", "1"])
    ran = [l for l in capsys.readouterr().out.splitlines() if l.startswith("ran ")]
    assert len(ran) == 8 and any("bf16 dot [1, 128] x [18, 128]" in l for l in ran)
