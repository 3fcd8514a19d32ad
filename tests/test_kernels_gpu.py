"""GPU-only kernel properties (skipped without a GPU). Run on the H200 at commit c15f057 with
tests/test_kernels.py compiled through Triton (42 passed: docs/benchmark_results/raw/2026-11-29-c15f057/
pytest_gpu.log); the same properties at more shapes: kernel_bench.py --phase check."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dequantize, quantize, quantized_matmul

pytestmark = pytest.mark.gpu


def test_kernels_compile_to_triton_and_keep_row_invariance_at_a_real_shape():
    rng = np.random.default_rng()
    qw = quantize(jnp.asarray(rng.standard_normal((3840, 2048)) * 0.05, jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
    hlo = jax.jit(lambda x: quantized_matmul(x, qw)).lower(x).as_text()
    assert "triton" in hlo.lower(), "the GPU path must lower through Pallas' Triton backend"
    multi = np.asarray(quantized_matmul(x, qw, path="multirow").astype(jnp.float32))
    for i in range(8):
        alone = np.asarray(quantized_matmul(x[i:i + 1], qw, path="qmv").astype(jnp.float32))
        np.testing.assert_array_equal(multi[i:i + 1], alone)
    ref = np.asarray(x, np.float64) @ np.asarray(dequantize(qw, jnp.float32), np.float64).T
    assert np.linalg.norm(multi - ref) / np.linalg.norm(ref) < 1e-2
