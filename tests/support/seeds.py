"""Seeded random inputs for the tests: fresh every run, replayable after a failure.

Each run draws one seed (conftest.py; pytest prints it at the end of the run), or takes
JAXSPEC_TEST_SEED. A test's generators derive from that seed, the test's id and how many it made
before, so `JAXSPEC_TEST_SEED=N pytest tests/test_x.py::test_y` gives a failed test its inputs
again, whatever ran before it or beside it (pytest -n).
"""
import os
import zlib

import numpy as np

SEED_ENV = "JAXSPEC_TEST_SEED"
_made: dict[str, int] = {}


def run_seed() -> int:
    return int(os.environ[SEED_ENV])


def seeded_rng() -> np.random.Generator:
    """A numpy Generator for the running test (or the importing module, outside a test)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]  # "file::test[id] (call)"
    n = _made[test] = _made.get(test, -1) + 1
    return np.random.default_rng([run_seed(), zlib.crc32(test.encode()), n])


def seeded_int(*bounds: int) -> int:
    """An integer in [0, high) or [low, high) (numpy's integers), e.g. a jax.random key's seed."""
    return int(seeded_rng().integers(*bounds))
