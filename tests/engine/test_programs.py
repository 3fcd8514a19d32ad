"""jaxspec.engine.programs: programs compiled at once (each lowered once per signature, compiled in its own
thread), kept per signature in memory, a lowering error raised to the caller. The on-disk half is
tested in subprocesses (test_compile_cache.py: a new process loads generate's programs whole)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import programs
from support.seeds import seeded_int


def _program(name, fn, args, lowered):
    def lower():
        lowered.append(name)
        return jax.jit(fn).lower(*args)
    return programs.Program(name, None, args, lower)


def test_compile_all_lowers_each_signature_once_and_runs_what_jit_runs():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    lowered = []
    f = lambda x, y: jnp.tanh(x @ y)  # noqa: E731
    g = lambda x: jnp.sum(x * x, axis=0)  # noqa: E731
    progs = [_program("f", f, (a, b), lowered), _program("g", g, (a,), lowered), _program("f", f, (a, b), lowered)]
    cf, cg, cf2 = programs.compile_all(progs)
    assert sorted(lowered) == ["f", "g"] and cf is cf2
    np.testing.assert_allclose(np.asarray(cf(a, b)), np.asarray(jax.jit(f)(a, b)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cg(a)), np.asarray(jax.jit(g)(a)), rtol=1e-6)
    assert programs.compiled(_program("g", g, (a,), lowered)) is cg and sorted(lowered) == ["f", "g"]
    # another shape is another program
    programs.compiled(_program("g", g, (a[:4],), lowered))
    assert sorted(lowered) == ["f", "g", "g"]
    programs.clear()
    programs.compiled(_program("g", g, (a,), lowered))
    assert sorted(lowered) == ["f", "g", "g", "g"]


def test_a_lowering_error_reaches_the_caller():
    x = jnp.ones((3, 4), jnp.float32)
    bad = _program("bad", lambda v: v @ v, (x,), [])  # (3, 4) @ (3, 4): a shape error when traced
    with pytest.raises(TypeError, match="dot_general"):
        programs.compile_all([_program("ok", lambda v: v + 1, (x,), []), bad])


def test_a_disk_entry_for_other_inputs_is_a_miss(tmp_path, monkeypatch):
    """An on-disk program whose inputs differ from the call's (here: the tree's metadata, a dict key,
    at equal shapes; what two keys' text cannot tell apart) is a miss: the program is compiled afresh
    and runs, where the loaded one made the call fail (issue 65). The fresh one then replaces it."""
    rng = np.random.default_rng(seeded_int(1 << 30))
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    path = str(tmp_path / "entry.bin")
    monkeypatch.setattr(programs, "_path", lambda program, sig: path)  # both programs' entry: one file
    f = lambda d: d["a"] * 2.0  # noqa: E731
    g = lambda d: jnp.sin(d["b"]) + 1.0  # noqa: E731
    a = _program("f", f, ({"a": x},), [])
    programs._save(path, programs.compiled(a))  # what A's run left on disk (JAX's cache may have served it)
    assert os.path.getsize(path) > 0
    programs.clear()
    lowered = []
    got = programs.compiled(_program("g", g, ({"b": x},), lowered))
    # against g itself under jit (float32 sin + 1 cancels near sin = -1: a float64 reference is off by
    # more than rtol there, whatever program ran)
    np.testing.assert_allclose(np.asarray(got({"b": x})), np.asarray(jax.jit(g)({"b": x})), rtol=1e-6)
    assert lowered == ["g"]  # compiled, not taken from the entry for {"a": ...}
    programs.clear()
    lowered = []
    assert programs.compiled(_program("f", f, ({"a": x},), lowered)) is not None and lowered == ["f"]
    programs.clear()
