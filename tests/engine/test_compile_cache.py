"""jaxspec.engine.compile_cache: the programs a generate call compiles (named, each once, none on a second
call of the same shapes), the on-disk cache the Python API turns on by default (a new process is
served from it) and its opt-out. The default is checked in subprocesses with HOME in a temp dir."""
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

import jaxspec
from jaxspec.engine import compile_cache
from jaxspec import models
from jaxspec.engine.compile_cache import CompileLog
from jaxspec.models import presets

from support.paths import REPO  # noqa: E402


def test_generate_compiles_each_named_program_once():
    t, a = presets.tiny_pair(5)
    rows = [np.random.default_rng(11).integers(3, t.config.vocab_size, 9).tolist()]
    with CompileLog() as first:
        jaxspec.generate(t, rows, assistant=a, max_new_tokens=10, block_size=4)
    names = first.names()
    # the probe runs its steps' width and the verify's: one program when the row bucket holds K = 4
    # rows, two (one each) on a CPU's xla backend, whose batch-1 steps run one row (models.row_bucket)
    probes = 1 if models.row_bucket(t, 1) >= 4 else 2
    for program, count in (("exactness_probe", probes), ("prefill", 1), ("decode", 1)):
        assert names.count(program) == count, names
    assert all(p.compile_s > 0 and p.lower_s > 0 for p in first.compiled if p.name in ("prefill", "decode"))
    rows2 = [np.random.default_rng(12).integers(3, t.config.vocab_size, 9).tolist()]
    with CompileLog() as second:
        jaxspec.generate(t, rows2, assistant=a, max_new_tokens=10, block_size=4)
    assert not {"exactness_probe", "prefill", "decode"} & set(second.names()), second.names()


_CHILD = """
import json, sys
import numpy as np
import pytest
import jaxspec
from jaxspec.engine import compile_cache
from jaxspec.models import presets
if sys.argv[1] == "off":
    compile_cache.disable_default()
t, _ = presets.tiny_pair(6)
with compile_cache.CompileLog() as log:
    out = jaxspec.generate(t, [[5, 6, 7, 8, 9]], max_new_tokens=6, block_size=1)
print(json.dumps(dict(hits=log.cache_hits, names=log.names(), loaded=log.loaded, tokens=out.tokens)))
"""


def _child(home, mode):
    env = dict(os.environ, HOME=str(home), PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_default_on_disk_cache_serves_a_new_process_and_opt_out(tmp_path):
    cache = tmp_path / "home" / ".cache" / "jaxspec" / "jax"
    off = _child(tmp_path / "home", "off")
    assert not cache.exists() and off["hits"] == 0
    cold = _child(tmp_path / "home", "on")
    assert cache.is_dir() and any(cache.iterdir())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700  # its files are loaded as code: only its user writes
    programs = cache / "jaxspec-programs"
    assert sorted(p.name.split("-")[0] for p in programs.iterdir()) == ["decode", "prefill"]
    assert not cold["loaded"] and {"prefill", "decode"} <= set(cold["names"])
    warm = _child(tmp_path / "home", "on")  # loads generate's programs whole: nothing traced or compiled
    assert sorted(warm["loaded"]) == ["decode", "prefill"]
    assert not {"prefill", "decode"} & set(warm["names"]), warm["names"]
    for p in programs.iterdir():  # without them (or with damaged ones), JAX's persistent cache serves
        p.write_bytes(p.read_bytes()[:100])
    rebuilt = _child(tmp_path / "home", "on")
    assert rebuilt["hits"] >= 2 and rebuilt["hits"] > cold["hits"] and not rebuilt["loaded"]
    # what JAX's cache served is not kept whole (a CPU executable it loaded re-serializes without
    # its code): the damaged files are gone and nothing replaced them, so the next process starts
    # from what `rebuilt` started from (no whole programs, JAX's cache warm) and runs as it did
    assert not any(programs.iterdir())
    assert warm["tokens"] == rebuilt["tokens"] == cold["tokens"] == off["tokens"]


def test_cache_directories_others_can_write_are_refused(tmp_path, monkeypatch):
    """Cached programs are unpickled and run: a directory another user (or the group) can write
    could plant one. An explicit one is a ValueError; the default is made 0700, and skipped with a
    warning when found unsafe."""
    d = tmp_path / "cache"
    d.mkdir()
    for mode, who in ((0o777, "others"), (0o770, "its group"), (0o702, "others")):
        d.chmod(mode)
        with pytest.raises(ValueError, match=rf"{d}.* is unsafe: it is writable by {who} \(mode 0{mode:o}\)"):
            compile_cache.checked_dir(str(d))
    d.chmod(0o755)
    assert compile_cache.checked_dir(str(d)) == str(d)
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(d, 4242, 4242)
        with pytest.raises(ValueError, match="is owned by uid 4242, not by this user"):
            compile_cache.checked_dir(str(d))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="it is not a directory"):
        compile_cache.checked_dir(str(tmp_path / "file"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = os.path.expanduser(compile_cache.DEFAULT_DIR)
    assert compile_cache.default_dir() == default and stat.S_IMODE(os.stat(default).st_mode) == 0o700
    os.chmod(default, 0o777)
    with pytest.warns(RuntimeWarning, match="running without the on-disk compile cache: .* is unsafe"):
        assert compile_cache.default_dir() is None


# ---- issue 51: a program planted in the cache never runs ----------------------------------------
# Each explicit directory named is tried in turn: refused (recorded), or turned on and generate runs;
# "default" (or all of them refused) runs generate with the default cache.
_ATTACKED = """
import json, sys, warnings
import jaxspec
from jaxspec.engine import compile_cache
from jaxspec.models import presets
refused = []
for where in sys.argv[1:]:
    if where == "default":
        break
    try:
        compile_cache.enable(where)
        break
    except ValueError as e:
        refused.append(str(e))
t, _ = presets.tiny_pair(6)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = jaxspec.generate(t, [[5, 6, 7, 8, 9]], max_new_tokens=6, block_size=1)
print(json.dumps(dict(refused=refused, tokens=out.tokens, warnings=[str(w.message) for w in caught])))
"""


class _Payload:
    """Unpickling this runs code: it writes the marker file (what a planted program would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"with open({self.marker!r}, 'w') as f: f.write('ran')",))


def _attacked(home, *where, umask=0o002):
    env = dict(os.environ, HOME=str(home), PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _ATTACKED, *map(str, where)], env=env, capture_output=True, text=True,
                       timeout=300, umask=umask)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_planted_program_never_runs(tmp_path):
    """The whole programs in `jaxspec-programs` are unpickled: one another user could have written
    (in a folder or file others can write, a file someone else owns, a directory others can enter
    while the umask lets JAX write files they can change) is never loaded. An explicit directory is
    refused, the default one skipped with a warning. All under umask 002, as the issue found it."""
    home = tmp_path / "home"
    cache = home / ".cache" / "jaxspec" / "jax"  # the default directory
    cache.mkdir(parents=True, mode=0o700)
    cold = _attacked(home, cache)  # writes the programs, named explicitly
    programs = cache / "jaxspec-programs"
    bins = sorted(programs.iterdir())
    assert [p.name.split("-")[0] for p in bins] == ["decode", "prefill"] and not cold["refused"]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [programs, *bins]}
    marker = tmp_path / "payload-ran"
    for p in bins:  # what a member of the group (or anyone, below) would put there
        p.write_bytes(pickle.dumps(_Payload(marker)))
    cases = {  # directory: (its mode, the programs folder's, the first file's, what is unsafe)
        "issue": (0o755, None, None, "others can enter it (mode 0755) and the umask (0002)"),
        "folder": (0o700, 0o777, None, "jaxspec-programs' is unsafe: it is writable by others (mode 0777)"),
        "file": (0o700, 0o700, 0o664, f"{bins[0].name}' is unsafe: it is writable by its group (mode 0664)"),
    }
    if os.geteuid() == 0:  # only root can give a file away
        cases["owner"] = (0o700, 0o700, 4242, f"{bins[0].name}' is unsafe: it is owned by uid 4242, not by this user")
    for name, (mode, folder, first, _) in cases.items():
        shutil.copytree(cache, tmp_path / name)
        (tmp_path / name).chmod(mode)
        if folder is not None:
            (tmp_path / name / "jaxspec-programs").chmod(folder)
        if first == 4242:
            os.chown(tmp_path / name / "jaxspec-programs" / bins[0].name, 4242, 4242)
        elif first is not None:
            (tmp_path / name / "jaxspec-programs" / bins[0].name).chmod(first)
    programs.chmod(0o777)  # and the default directory
    got = _attacked(home, *(tmp_path / name for name in cases), "default")
    assert not marker.exists(), f"the planted program ran: {got}"
    assert len(got["refused"]) == len(cases), got
    for (name, (*_, why)), refused in zip(cases.items(), got["refused"]):
        assert str(tmp_path / name) in refused and why in refused, (name, refused)
    assert any("running without the on-disk compile cache" in w and "jaxspec-programs' is unsafe" in w
               for w in got["warnings"]), got["warnings"]
    assert got["tokens"] == cold["tokens"]
    # what jaxspec wrote itself under umask 002: only its user can write (or enter) it
    assert modes == {"jaxspec-programs": 0o700, **{p.name: 0o600 for p in bins}}, modes


def test_jax_cache_files_others_can_change_are_refused(tmp_path):
    """JAX's own `*-cache` files are executables too: writable by others in a directory they can
    enter, the directory is refused; in one only its user can enter, JAX's umask-made mode is kept."""
    d = tmp_path / "cache"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    (d / "jit_f-0123abcd-cache").write_bytes(np.random.default_rng().bytes(64))
    (d / "jit_f-0123abcd-cache").chmod(0o664)
    (d / "notes.txt").write_text("not read by the cache")
    (d / "notes.txt").chmod(0o666)
    with pytest.raises(ValueError, match=r"jit_f-0123abcd-cache' is unsafe: it is writable by its group"):
        compile_cache.checked_dir(str(d))
    d.chmod(0o700)
    assert compile_cache.checked_dir(str(d)) == str(d)
    (d / "jit_f-0123abcd-cache").unlink()
    os.symlink(tmp_path / "elsewhere", d / "jit_g-4567-cache")
    with pytest.raises(ValueError, match=r"jit_g-4567-cache' is unsafe: it is a symbolic link"):
        compile_cache.checked_dir(str(d))


# ---- issue 65: a cache directory in a folder others can write -------------------------------------
def test_a_cache_in_a_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    """~/.cache/jaxspec/jax as a link another user planted, its folder writable by others: it was
    used (the link's target passed every check). Such a folder lets them swap in their own directory
    at any time, so the cache in it is refused, a link or not: an explicit one is a ValueError, the
    default is skipped with one warning. With the sticky bit (as /tmp) nobody else can replace it."""
    home = tmp_path / "home"
    folder = home / ".cache" / "jaxspec"
    folder.mkdir(parents=True)
    target = tmp_path / "looks-fine"
    target.mkdir(mode=0o700)
    (folder / "jax").symlink_to(target)
    folder.chmod(0o777)
    monkeypatch.setenv("HOME", str(home))
    why = rf"is unsafe: its folder '{folder}' is writable by others \(mode 0777, not sticky\)"
    with pytest.warns(RuntimeWarning, match="running without the on-disk compile cache: .*" + why):
        assert compile_cache.default_dir() is None
    with pytest.raises(ValueError, match=why):
        compile_cache.checked_dir(str(folder / "jax"))
    (folder / "jax").unlink()
    with pytest.raises(ValueError, match=why):  # not made there either
        compile_cache.checked_dir(str(folder / "jax"))
    assert not (folder / "jax").exists()
    (folder / "jax").mkdir(mode=0o700)
    with pytest.raises(ValueError, match=why):  # a real directory of this user's, but replaceable
        compile_cache.checked_dir(str(folder / "jax"))
    folder.chmod(0o1777)
    assert compile_cache.checked_dir(str(folder / "jax")) == str(folder / "jax")
    (folder / "jax").rmdir()
    (folder / "jax").symlink_to(target)  # a link in a sticky folder: only its owner could change it
    assert compile_cache.checked_dir(str(folder / "jax")) == str(folder / "jax")
