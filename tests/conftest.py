import jax
import pytest

jax.config.update("jax_enable_x64", False)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# In-process tests keep no on-disk compilation cache (jaxspec turns one on by default): a run
# never depends on what an earlier run left in ~/.cache. tests/test_compile_cache.py checks the default.
from jaxspec import compile_cache, programs  # noqa: E402

compile_cache.disable_default()


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Free each module's compiled programs when it ends. Every XLA CPU executable keeps memory
    mappings, and one process running the whole suite reached the kernel's limit of 65,530
    (vm.max_map_count) and crashed inside a compile."""
    yield
    jax.clear_caches()
    programs.clear()
