"""The weights cache (jaxspec.weights_cache): a GGUF converted once, keyed by its content, checked by
size and checksum, and what `jaxspec generate` does with it, on tiny GGUFs (support.gguf_files).

References: the GGUF loaded as it is (models.load_target on the .gguf) for the entry's weights;
`--no-weights-cache` for the CLI's text; an entry damaged on disk (cut, one byte flipped, its record
garbled) must be a miss and be rebuilt, never a crash."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import cli, models, weights_cache
from jaxspec.kernels import DispatchConfig
from jaxspec.models.layer_scan import unstack_params
from support.gguf_files import write_tiny
from support.seeds import seeded_rng

STORED = DispatchConfig(backend="xla", dense=False)  # the weights as loaded, not the CPU's dense copies


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("wc_gguf") / "tiny.gguf", seeded_rng())


def _leaves(path, dtype):
    params = unstack_params(*(lambda t: (t.config, t.params))(models.load_target(path, dtype=dtype, matmul=STORED)))
    return {name: [np.asarray(x) for x in jax.tree_util.tree_leaves(w)] for name, w in params.items()}


def test_an_entry_loads_as_its_gguf_and_only_that_gguf_finds_it(tiny, tmp_path):
    """build -> lookup finds the entry, whose weights equal the GGUF's own load leaf for leaf (in
    bfloat16, what runs by default; tests/models/test_gguf.py checks `convert` in float32); a copy of the file elsewhere finds it too (keyed by content), a rewritten
    file with other weights does not."""
    root = str(tmp_path / "cache")
    assert weights_cache.lookup(tiny, root) is None
    entry = weights_cache.build(tiny, root)
    assert weights_cache.lookup(tiny, root) == entry and os.path.dirname(os.path.dirname(entry)) == root
    assert oct(os.stat(entry).st_mode & 0o777) == "0o700"
    a, b = _leaves(tiny, jnp.bfloat16), _leaves(entry, jnp.bfloat16)
    assert sorted(a) == sorted(b)
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(open(tiny, "rb").read())
    assert weights_cache.lookup(str(copy), root) == entry
    write_tiny(copy, seeded_rng())  # same path and size, other weights
    assert weights_cache.lookup(str(copy), root) is None


@pytest.mark.parametrize("damage", ["truncated", "flipped", "record", "missing"])
def test_a_damaged_entry_is_a_miss_and_is_rebuilt(tiny, tmp_path, damage):
    root = str(tmp_path / "cache")
    entry = weights_cache.build(tiny, root)
    weights = os.path.join(entry, "model.safetensors")
    good = open(weights, "rb").read()
    if damage == "truncated":
        open(weights, "wb").write(good[:len(good) // 2])
    elif damage == "flipped":  # same size, one byte of the data changed
        at = int(seeded_rng().integers(len(good) // 2, len(good)))
        open(weights, "wb").write(good[:at] + bytes([good[at] ^ 0x10]) + good[at + 1:])
    elif damage == "record":
        open(os.path.join(entry, weights_cache.ENTRY_FILE), "w").write('{"files": {"a": 1}')
    else:
        os.remove(os.path.join(entry, "tokenizer.json"))
    assert weights_cache.lookup(tiny, root) is None
    assert weights_cache.build(tiny, root) == entry and weights_cache.lookup(tiny, root) == entry
    assert open(weights, "rb").read() == good
    assert [n for n in os.listdir(os.path.dirname(entry)) if n.startswith(".")] == []  # no temporary folder left


def test_generate_converts_once_then_reads_the_cache(tiny, tmp_path, capsys, monkeypatch):
    """`jaxspec generate --model X.gguf`: the first run converts into $JAXSPEC_WEIGHTS_CACHE (one
    line says where), the next reads the entry (one line says so, nothing converted), a truncated
    entry is converted again; the text is --no-weights-cache's every time."""
    monkeypatch.setenv(weights_cache.ENV, str(tmp_path / "cache"))
    builds = []
    real = weights_cache.build
    monkeypatch.setattr(weights_cache, "build", lambda *a, **k: builds.append(a[0]) or real(*a, **k))
    sized, check = [], cli._check_memory  # the memory check sizes the weights by the GGUF, hit or miss
    monkeypatch.setattr(cli, "_check_memory", lambda *a: sized.append(a[-1]) or check(*a))
    argv = ["generate", "t5 t9 t12", "--model", tiny, "--max-tokens", "6", "--no-stats"]

    def run(*extra):
        assert cli.main(argv + list(extra)) == 0
        return capsys.readouterr()

    plain = run("--no-weights-cache")
    assert builds == [] and "weights cache" not in plain.err
    first = run()
    entry = weights_cache.lookup(tiny)
    assert builds == [tiny] and entry is not None and entry.startswith(str(tmp_path / "cache"))
    assert f"weights cache: {entry}" in first.err and first.out == plain.out
    second = run()
    assert builds == [tiny] and f"weights from the cache {entry}" in second.err and second.out == plain.out
    weights = os.path.join(entry, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 1)
    third = run()
    assert builds == [tiny, tiny] and "converting" in third.err and third.out == plain.out
    assert weights_cache.lookup(tiny) == entry and sized == [os.path.getsize(tiny)] * 4


def test_chat_on_a_cached_gguf_names_the_gguf(tiny, tmp_path, capsys, monkeypatch):
    """`--chat` on a GGUF without a chat template is refused (exit 2) with the GGUF's own message, the
    one --no-weights-cache gives (its file named, "a base model?"), also once the run reads the
    cache's entry: not "this model directory", a directory the user never named."""
    monkeypatch.setenv(weights_cache.ENV, str(tmp_path / "cache"))
    weights_cache.build(tiny, str(tmp_path / "cache"))
    argv = ["generate", "t5 t9", "--model", tiny, "--chat", "--max-tokens", "2"]
    errs = []
    for extra in ([], ["--no-weights-cache"]):
        assert cli.main(argv + extra) == 2
        errs.append(capsys.readouterr().err.splitlines()[-1])
    assert errs[0] == errs[1] and f"{tiny} has no chat template" in errs[0] and "a base model?" in errs[0], errs
