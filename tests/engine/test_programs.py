"""jaxspec.engine.programs: programs compiled at once (each lowered once per signature, compiled in its own
thread), kept per signature in memory, a lowering error raised to the caller. The on-disk half is
tested in subprocesses (test_compile_cache.py: a new process loads generate's programs whole)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import programs


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
