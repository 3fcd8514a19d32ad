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

from support.paths import REPO  # noqa: E402
CACHE = os.environ["JAXSPEC_TEST_COMPILE_CACHE"]  # this run's, made by conftest.py


@pytest.fixture(scope="module")
def hostile_cwd(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_project")
    for name in ("models", "pallas_kernels"):
        (d / f"{name}.py").write_text(f"raise RuntimeError('the user\\'s {name}.py was imported')\n")
    return d


def run(cwd, *args, timeout=300):
    # the worktree first on the path (as tests/cli/test_cli.py), yet after the working directory
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_users_modules_really_raise(hostile_cwd):
    """The fixture is hostile: a plain `import models` there fails (else the tests below prove nothing)."""
    for name in ("models", "pallas_kernels"):
        r = run(hostile_cwd, "-c", f"import {name}")
        assert r.returncode == 1 and f"the user's {name}.py was imported" in r.stderr, r.stderr


def test_import_jaxspec_beside_user_modules(hostile_cwd):
    code = ("import jaxspec, jaxspec.models as m, jaxspec.kernels as k, jaxspec.cli, jaxspec.train.default_pair; "
            "import sys; "
            "assert 'models' not in sys.modules and 'pallas_kernels' not in sys.modules, 'top-level name imported'; "
            "print(k.ROW_TILE, m.TargetConfig.__module__, jaxspec.generate.__module__)")
    r = run(hostile_cwd, "-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["16", "jaxspec.models.config", "jaxspec.engine.generate"]


def test_cli_beside_user_modules(hostile_cwd):
    pair = hostile_cwd / "pair"
    r = run(hostile_cwd, "-m", "jaxspec", "tiny-pair", str(pair))
    assert r.returncode == 0, r.stderr
    r = run(hostile_cwd, "-m", "jaxspec", "generate", "hi", "--pair", str(pair), "--max-tokens", "6",  # as test_cli_tiny_pair
            "--compile-cache", CACHE, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["new_tokens"] >= 1 and out["stats"]["mode"] == "speculative"


def _installed_from_this_checkout() -> bool:
    """jaxspec is installed editable from this checkout (as `make venv-dev` / CI do): read from a
    folder outside it, where the checkout's own jaxspec.egg-info is not on the path."""
    code = ("import json, importlib.metadata as m\n"
            "try:\n"
            "    d = json.loads(m.distribution('jaxspec').read_text('direct_url.json') or '{}')\n"
            "except m.PackageNotFoundError:\n"
            "    d = {}\n"
            "print(d.get('dir_info', {}).get('editable', False), d.get('url', ''))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(REPO), env=env, capture_output=True,
                       text=True, timeout=60)
    editable, _, url = r.stdout.strip().partition(" ")
    return editable == "True" and os.path.realpath(url.removeprefix("file://")) == os.path.realpath(REPO)


@pytest.mark.skipif(not _installed_from_this_checkout(), reason="needs jaxspec installed editable (make venv-dev)")
def test_an_editable_install_exposes_only_jaxspec(tmp_path):
    """Outside the checkout, with nothing on PYTHONPATH, the editable install makes `jaxspec` (and its
    mapped jaxspec.models / jaxspec.kernels) importable and none of the checkout's other top-level
    folders: the old `package-dir = {"" = "."}` put the checkout root on sys.path, so `import models`
    loaded a second copy of every class (programs compiled with one copy, read back with the other)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib, sys\n"
            "for name in ('models', 'pallas_kernels', 'tests', 'benchmarks', 'docs'):\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError:\n"
            "        continue\n"
            "    sys.exit('importable: ' + name)\n"
            "import jaxspec, jaxspec.models, jaxspec.kernels\n"
            "print(jaxspec.models.TargetConfig.__module__, jaxspec.kernels.ROW_TILE)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    assert r.stdout.split() == ["jaxspec.models.config", "16"]


def test_the_wheel_holds_models_and_kernels_under_jaxspec_only(tmp_path):
    """The built wheel maps models/ -> jaxspec/models and pallas_kernels/ -> jaxspec/kernels, ships the
    package data, and has no other top-level package."""
    import zipfile

    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path), REPO], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("jaxspec-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"jaxspec"}, tops
    for must in ("jaxspec/models/target.py", "jaxspec/models/gemma3.py", "jaxspec/kernels/quant.py",
                 "jaxspec/engine/loop.py", "jaxspec/data/default_pair/target/model.safetensors",
                 "jaxspec/data/default_pair/tokenizer.json", "jaxspec/data/drafters/README.md"):
        assert must in names, must
