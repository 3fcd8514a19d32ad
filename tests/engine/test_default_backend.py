"""The Python loaders pick the matmul backend by the CLI's rule (issue 50): with `matmul=None`,
`models.load_target` / `load_assistant`, `models.presets` and `load_default_pair` build
`DispatchConfig.from_env(backend="auto")`, which is what `jaxspec generate --backend auto` builds:
the Pallas kernels on a GPU, XLA's dequantize + dot elsewhere (the Pallas interpreter ran the Python
API ~8x slower than the CLI on a CPU). Asking for Pallas still gets Pallas. `GenerationStats.backend`
says which path ran."""
import jax
import pytest

from jaxspec import cli, default_pair, models
from jaxspec.kernels import DispatchConfig, resolve_backend
from jaxspec.models import presets

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU side of the rule")


def test_the_rule_is_one_function(monkeypatch):
    assert resolve_backend("auto") == "xla" and cli._matmul_config("auto").backend == "xla"
    assert resolve_backend("pallas") == "pallas" and resolve_backend("xla") == "xla"
    with pytest.raises(ValueError, match="backend='cuda'"):
        resolve_backend("cuda")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # what both would do on a GPU
    assert resolve_backend("auto") == "pallas" and cli._matmul_config("auto").backend == "pallas"
    assert DispatchConfig.from_env(backend="auto").backend == "pallas"


def test_loaders_build_what_the_cli_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSPEC_QMV_MULTIROW_MAX_ROWS", "8")  # the environment's knobs still apply
    want = cli._matmul_config("auto")
    assert want.backend == "xla" and want.multirow_max_rows == 8
    target, assistant = presets.tiny_pair(seed=1)
    models.save(target, str(tmp_path / "t"))
    models.save(assistant, str(tmp_path / "a"))
    loaded = [models.load_target(str(tmp_path / "t")), models.load_assistant(str(tmp_path / "a"))]
    if default_pair.default_pair_available():
        loaded += default_pair.load_default_pair()[:2]
    for m in loaded:
        assert m.matmul == want, type(m).__name__
    # the presets' models (made to save, train or shard) keep their weights quantized: dense off
    for m in (target, assistant, presets.random_model(target.config, jax.random.key(0))):
        assert m.matmul == want.replace(dense=False), type(m).__name__
    pallas = DispatchConfig.from_env(backend="pallas")
    assert models.load_target(str(tmp_path / "t"), matmul=pallas).matmul.backend == "pallas"  # asked: kept
    assert presets.tiny_pair(seed=1, matmul=pallas)[0].matmul.backend == "pallas"


def test_describe_names_the_path():
    """What GenerationStats.backend reports (a run's stats are checked in test_cli_tiny_pair, which
    generates anyway)."""
    assert DispatchConfig(backend="xla").describe == "xla"
    assert DispatchConfig(backend="pallas", interpret=True).describe == "pallas (interpret mode)"
    assert DispatchConfig(backend="pallas", interpret=False).describe == "pallas"
