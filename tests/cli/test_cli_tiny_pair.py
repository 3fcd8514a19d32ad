"""`jaxspec tiny-pair DIR` (issue 41, case 8): it never replaces what is in DIR without --force, and a
DIR it cannot write is one line naming the path, exit status 2, found before any model is built."""
import json
import logging
import os
import re

import pytest

from jaxspec import cli, models
from jaxspec.engine import programs
from jaxspec.models import presets


@pytest.fixture
def no_model_building(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was built before the output directory was checked")
    monkeypatch.setattr(presets, "tiny_pair", refuse)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxspec: error: ") and len(err) < 400, err
    return err


def test_a_non_empty_dir_needs_force(tmp_path, capsys, no_model_building):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "tokenizer.json").write_text("mine")
    assert cli.main(["tiny-pair", str(tmp_path)]) == 2
    err = one_error_line(capsys)
    assert f"'{tmp_path}' is not empty" in err and "--force" in err, err
    assert (tmp_path / "target" / "tokenizer.json").read_text() == "mine"


@pytest.mark.parametrize("case", ["a file", "under a file", "unwritable"])
def test_a_dir_that_cannot_be_written_is_named(tmp_path, capsys, no_model_building, case):
    if case == "unwritable":
        path = tmp_path / "ro" / "pair"
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o500)
        if os.access(tmp_path / "ro", os.W_OK):
            (tmp_path / "ro").chmod(0o700)
            pytest.skip("this process ignores permission bits (root)")
        expect = "permission denied"
    else:
        (tmp_path / "f").write_text("precious")
        path = tmp_path / "f" if case == "a file" else tmp_path / "f" / "pair"
        expect = "is not a directory"
    try:
        assert cli.main(["tiny-pair", str(path)]) == 2
        err = one_error_line(capsys)
    finally:
        (tmp_path / "ro").chmod(0o700) if case == "unwritable" else None
    assert f"'{path}'" in err or f"'{tmp_path / 'f'}'" in err, err
    assert expect in err, err
    assert case == "unwritable" or (tmp_path / "f").read_text() == "precious"


def test_force_switches_the_whole_pair_at_once(tmp_path, capsys):
    """--force over a pair written before (real directories, a file of the user's in one): the new
    pair is written whole beside it and switched by one link (issue 51; the kill test is in
    test_checkpoint_kill.py); the user's file is kept, moved with the old directory."""
    import json

    from jaxspec.models import checkpoint_files

    for name in ("target", "assistant"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"old": true}')
    (tmp_path / "target" / "notes.txt").write_text("mine")
    assert cli.main(["tiny-pair", str(tmp_path), "--force", "--seed", "3"]) == 0
    for name in ("target", "assistant"):
        assert os.readlink(tmp_path / name) == os.path.join(".pair", name)
        config, weights = checkpoint_files.read_config(str(tmp_path / name))
        assert "old" not in config and weights
    assert json.loads((tmp_path / "target" / "tokenizer.json").read_text())["model"]["vocab"]
    kept = [p for p in tmp_path.glob(".pair-*/target/notes.txt")]
    assert [p.read_text() for p in kept] == ["mine"]


def test_tiny_pair_then_generate_with_pair(tmp_path, capsys):
    """`jaxspec tiny-pair DIR` also writes the default pair's layout (a shared DIR/tokenizer.json), so
    `jaxspec generate hi --pair DIR` runs, as the command's own hint says (issue 50: it exited 2,
    "lacks tokenizer.json"); its tokens are jaxspec.generate's on presets.tiny_pair, tokenized alike,
    and both ran the XLA matmul path (the loaders' and the CLI's rule on a CPU)."""
    import jaxspec
    from jaxspec.text import load_tokenizer

    d = str(tmp_path / "pair")
    assert cli.main(["tiny-pair", d]) == 0
    hint = capsys.readouterr().out
    assert f"--pair {d}" in hint, hint
    cache = os.environ["JAXSPEC_TEST_COMPILE_CACHE"]  # the run's (conftest.py): test_import_isolation shares it
    programs.clear()  # nothing compiled in this process yet: the CLI must compile (JAX's cache may serve it)
    assert cli.main(["generate", "hi", "--pair", d, "--max-tokens", "6", "--compile-cache", cache, "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    # the compile line: when it starts and how long it took, always shown by the CLI (the library's
    # logging lines; the library alone is silent), in order, naming the same programs: the probe
    # compiles its step's width and the verify's, one program where they are equal (a row bucket of
    # K), two on a CPU's xla backend, whose batch-1 steps run one row (models.row_bucket)
    target, assistant = presets.tiny_pair(seed=0)  # what tiny-pair saved (4-bit: saved and loaded exactly)
    probes = 1 if models.row_bucket(target, 1) >= 4 else 2  # K = 4, the CLI's default
    names = f"{2 + probes} programs (decode, prefill{', exactness_probe' * probes})"
    err = captured.err.splitlines()
    start = err.index(f"jaxspec: compiling {names} (the first run for these shapes can take a while) ...")
    assert any(re.fullmatch(rf"jaxspec: compiled {re.escape(names)} in \d+\.\d s", line) for line in err[start + 1:]), err
    assert not logging.getLogger("jaxspec").handlers  # the CLI's handler is gone again
    with open(os.path.join(d, "tokenizer.json"), "rb") as shared, open(os.path.join(d, "target", "tokenizer.json"),
                                                                       "rb") as own:
        assert shared.read() == own.read()  # the pair's shared file, and the target directory's own
    tok = load_tokenizer(os.path.join(d, "target"))
    ref = jaxspec.generate(target, [tok.encode("hi")], assistant=assistant, max_new_tokens=6,
                           eos_token_ids=tok.eos_token_ids)
    assert out["tokens"] == ref.tokens[0] and out["prompt_tokens"] == len(tok.encode("hi"))
    # both on the XLA path without being asked (CPU), and their stats say so (issue 50)
    assert out["stats"]["backend"] == ref.stats.backend == "xla" and "backend='xla'" in repr(ref.stats)
