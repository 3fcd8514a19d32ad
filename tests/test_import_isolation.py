"""A user's `models.py` and `pallas_kernels.py` beside their script change nothing (issue 50).

jaxspec's models and kernels import only as `jaxspec.models` / `jaxspec.kernels`, never as top-level
`models` / `pallas_kernels` (the wheel used to install those names, and a user's models.py shadowed
them: `AttributeError: module 'models' has no attribute 'ROW_TILE'`). Here both files raise on
import, in the working directory of real subprocesses (`python -c` and `python -m` put the working
directory first on sys.path): `import jaxspec` with its subpackages, and the CLI writing a tiny pair
and generating from it, must work as they do elsewhere.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ["JAXSPEC_TEST_COMPILE_CACHE"]  # this run's, made by conftest.py


@pytest.fixture(scope="module")
def hostile_cwd(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_project")
    for name in ("models", "pallas_kernels"):
        (d / f"{name}.py").write_text(f"raise RuntimeError('the user\\'s {name}.py was imported')\n")
    return d


def run(cwd, *args, timeout=300):
    # the worktree first on the path (as tests/test_cli.py), yet after the working directory
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_users_modules_really_raise(hostile_cwd):
    """The fixture is hostile: a plain `import models` there fails (else the tests below prove nothing)."""
    for name in ("models", "pallas_kernels"):
        r = run(hostile_cwd, "-c", f"import {name}")
        assert r.returncode == 1 and f"the user's {name}.py was imported" in r.stderr, r.stderr


def test_import_jaxspec_beside_user_modules(hostile_cwd):
    code = ("import jaxspec, jaxspec.models as m, jaxspec.kernels as k, jaxspec.cli, jaxspec.default_pair.train; "
            "import sys; "
            "assert 'models' not in sys.modules and 'pallas_kernels' not in sys.modules, 'top-level name imported'; "
            "print(k.ROW_TILE, m.TargetConfig.__module__, jaxspec.generate.__module__)")
    r = run(hostile_cwd, "-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["16", "jaxspec.models.config", "jaxspec.generate"]


def test_cli_beside_user_modules(hostile_cwd):
    pair = hostile_cwd / "pair"
    r = run(hostile_cwd, "-m", "jaxspec", "tiny-pair", str(pair))
    assert r.returncode == 0, r.stderr
    r = run(hostile_cwd, "-m", "jaxspec", "generate", "hi", "--pair", str(pair), "--max-tokens", "6",  # as test_cli_tiny_pair
            "--compile-cache", CACHE, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["new_tokens"] >= 1 and out["stats"]["mode"] == "speculative"
