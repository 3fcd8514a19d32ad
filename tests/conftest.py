import os
import secrets
import shutil
import tempfile

# Compile-bound on CPU: about 80% of a test's time is XLA compiling tiny programs, and LLVM's backend
# optimisations are a quarter of that (tests/engine/test_batching.py 48.5 -> 39.4 s without them). The few
# runs that execute a lot (the default pair's decoding) get ~2x slower; the suite as a whole is 15%
# faster (1,385 -> 1,184 s on the 2-core CI machine). Set before JAX starts its backend (below), and
# inherited by every subprocess a test starts.
FAST_COMPILE = "--xla_backend_optimization_level=0"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from support.seeds import SEED_ENV, run_seed  # noqa: E402

jax.config.update("jax_enable_x64", False)

# One on-disk compile cache per test run, made here (by the xdist controller, or the lone process)
# and handed through the environment to the xdist workers and to every subprocess a test starts
# (the CLI, the server, the notebook kernel, the training recipe): a program compiles once per run
# whatever process needs it, and no run depends on what an earlier run left behind.
CACHE_ENV = "JAXSPEC_TEST_COMPILE_CACHE"


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller: the workers inherit what it sets
        config._jaxspec_cache = tempfile.mkdtemp(prefix="jaxspec-test-compile-cache-")
        os.environ[CACHE_ENV] = os.environ["JAX_COMPILATION_CACHE_DIR"] = config._jaxspec_cache
        # GGUF weights converted by the CLI (jaxspec.weights_cache) go there too, never into ~/.cache
        os.environ["JAXSPEC_WEIGHTS_CACHE"] = os.path.join(config._jaxspec_cache, "weights")
        os.environ.setdefault(SEED_ENV, str(secrets.randbits(32)))
        # pytest-xdist (3.x) hands out files with the most tests first unless told not to, which put
        # the slowest files (few long tests: test_shard's 5, test_default_pair's 10) near the end of
        # the run, where one worker finished them alone. SLOW_FILES' order is the one to keep.
        if getattr(config.option, "loadscopereorder", False):
            config.option.loadscopereorder = False
    from jaxspec.engine import compile_cache, programs

    compile_cache.disable_default()
    # compile_cache.enable's settings, set here since JAX may have read the directory already
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # In this process programs are not kept whole on disk: tests monkeypatch traced functions (the
    # exactness probe's forward), which a whole program's key cannot see. JAX's own cache is keyed by
    # the lowered program, so it stays on.
    programs.directory = lambda: None


def pytest_unconfigure(config):
    path = getattr(config, "_jaxspec_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"random test inputs: {SEED_ENV}={run_seed()} replays them")


# The files that take longest on 2 CPU cores, longest first (per-file wall of a fast-tier run,
# 2026-12-05; about 1-3.5 min each on the CI machine). `make test` hands out whole files to its
# workers (pytest -n 2 --dist loadfile) in collection order (xdist's own reordering is off:
# pytest_configure), so these start first, the short files fill in after them, and no long file is
# left running alone at the end. The rest go most tests first.
SLOW_FILES = ("test_long_context.py", "test_generate.py", "test_batching.py", "test_serve_bench.py", "test_server.py",
              "test_sampling_generate.py", "test_flash_attention.py", "test_paged_batching.py", "test_cli.py",
              "test_ngram_serving.py", "test_compile_cache.py", "test_ngram_drafter.py", "test_decode_attention.py",
              "test_kernel_bench.py", "test_layer_scan.py", "test_kernels.py", "test_default_pair.py",
              "test_penalties_generate.py", "test_context_bench.py", "test_batch_invariance.py", "test_server_pool.py",
              "test_speculative_bench.py", "test_server_traffic.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    count = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1
    # stable: the order within a file is kept
    items.sort(key=lambda item: (rank.get(item.path.name, len(SLOW_FILES)), -count[item.path]))
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pair(tmp_path_factory) -> tuple[str, str]:
    """The (target, assistant) directories of one `jaxspec tiny-pair`, made once per worker for the
    modules that only read them (a test that changes a pair copies it first)."""
    from jaxspec import cli

    root = str(tmp_path_factory.mktemp("pair"))
    assert cli.main(["tiny-pair", root]) == 0
    return os.path.join(root, "target"), os.path.join(root, "assistant")


@pytest.fixture(scope="module")
def tiny_server(pair):
    """Starts `jaxspec serve` on the session's tiny pair: tiny_server(*flags, api_key=None) -> a
    running test_server.Running, stopped when the module ends. Every server it starts has the same
    batch settings (16 slots, 2 rounds per chunk), so the first warm-up's programs serve the others
    from the run's compile cache; the modules differ only in their connection and guard flags."""
    from support.server_proc import Running

    started = []

    def start(*flags, api_key=None):
        started.append(Running("--model", pair[0], "--assistant", pair[1], "--max-batch", "16",
                               "--rounds-per-chunk", "2", *flags, api_key=api_key))
        return started[-1]
    yield start
    for s in started:
        s.stop()


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Free each module's compiled programs when it ends. Every XLA CPU executable keeps memory
    mappings, and one process running the whole suite reached the kernel's limit of 65,530
    (vm.max_map_count) and crashed inside a compile. The run's disk cache serves them again."""
    yield
    from jaxspec.engine import programs

    jax.clear_caches()
    programs.clear()
