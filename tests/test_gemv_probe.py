"""The stream probe reads every word, scale and bias exactly once (its checksum), whatever its grid
and whether the words are row-major or tile-major."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from gemv_probe import stream  # noqa: E402
from kernel_bench import random_qweight  # noqa: E402
from pallas_kernels import with_sb_layout, with_w_layout  # noqa: E402


@pytest.mark.parametrize("n,block_n,gps,split,layout,tiles", [
    (64, 16, 1, 1, "nk", False), (64, 32, 2, 2, "kn", False), (64, 16, 4, 2, "nk", False), (72, 32, 2, 3, "nk", False),
    (80, 64, 4, 3, "kn", False),  # partial tiles, steps
    (64, 32, 2, 2, "kn", True), (128, 64, 4, 3, "nk", True)])  # a tile-major copy of the words
@pytest.mark.parametrize("w_layout", ["rows", "tiles"])  # stored either way; stream() reads qw.words()
def test_stream_checksum_counts_every_byte_once(n, block_n, gps, split, layout, tiles, w_layout):
    qw = with_sb_layout(random_qweight(jax.random.PRNGKey(block_n * 10 + gps + split), n, 512), layout)
    if n % 64 == 0:
        qw = with_w_layout(qw, w_layout)
    got = np.asarray(stream(qw, block_n=block_n, gps=gps, split_k=split, tiles=tiles)).sum(axis=0, dtype=np.uint64)
    words = np.asarray(qw.words()).astype(np.uint64).sum(axis=1)
    sb = sum(np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16)).astype(np.uint64).sum(axis=1)
             for a in qw.sb_nk())
    np.testing.assert_array_equal(got % 2**32, (words + sb) % 2**32)
