"""Shared by the tests (moved from tests/cli/test_cli.py: no test module imports another)."""
import os
import subprocess
import sys

from support.paths import REPO


CACHE = os.environ["JAXSPEC_TEST_COMPILE_CACHE"]  # this run's, made by conftest.py


def run_cli(*args, stdin=None, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-m", "jaxspec", *args], cwd=REPO, env=env,
                       input=None if stdin is None else stdin.encode(), capture_output=True, timeout=timeout)
    # decoded by hand: text mode would turn a generated "\r" into "\n"
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    return r
