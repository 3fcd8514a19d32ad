"""`kernels.xla.row_sum` / `row_max`: a row's result does not depend on how many rows share the call
(on a CPU XLA picks a reduce's code by its size, which is why they exist: docs/design.md), and
they are the sum and max of the row (float32 rounding apart for the sum; the max exactly)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.xla import row_max, row_sum
from support.seeds import seeded_rng


@pytest.mark.parametrize("width", [21, 256, 640])  # a sliding ring's keys (odd: a carried element), hidden sizes
def test_a_rows_sum_and_max_are_the_same_bits_at_any_row_count(width):
    rng = seeded_rng()
    x = (rng.standard_normal((64, width)) * np.exp(rng.uniform(-4, 4, (64, 1)))).astype(np.float32)
    s, m = jax.jit(row_sum), jax.jit(row_max)
    all_s, all_m = np.asarray(s(jnp.asarray(x))), np.asarray(m(jnp.asarray(x)))
    assert all_s.shape == all_m.shape == (64, 1)
    for rows in (1, 2, 4, 7, 16):
        np.testing.assert_array_equal(np.asarray(s(jnp.asarray(x[:rows]))), all_s[:rows], err_msg=f"sum, {rows} rows")
        np.testing.assert_array_equal(np.asarray(m(jnp.asarray(x[:rows]))), all_m[:rows], err_msg=f"max, {rows} rows")
    exact = np.sum(x.astype(np.float64), axis=-1, keepdims=True)
    scale = np.sum(np.abs(x.astype(np.float64)), axis=-1, keepdims=True)
    assert np.all(np.abs(all_s - exact) <= 1e-6 * scale)  # pairwise: error ~ log2(width) roundings
    np.testing.assert_array_equal(all_m, x.max(axis=-1, keepdims=True))
    # batched like the attention's scores: [B, H, T, C], the last axis reduced
    y = x[:48].reshape(2, 3, 8, width)
    np.testing.assert_array_equal(np.asarray(s(jnp.asarray(y))).reshape(48, 1), all_s[:48])
