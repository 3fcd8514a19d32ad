"""The CLI at its process edges (issue 41): closed stdout / stderr, a JAX_PLATFORMS that cannot
start, an unsafe --compile-cache, a reader that closes the pipe, messages of any length, and the
exit-status rule (what the user can fix: 2; a bug: 1). The few subprocesses stop before any model
is loaded: their model directory has a config and a tokenizer but no weights."""
import json
import os
import subprocess
import sys

import pytest

from jaxspec import cli
from jaxspec.text.tokenizer import DEMO_CORPUS, TokenizerError, train_byte_bpe
from jaxspec.models import presets
from support.seeds import seeded_rng

from support.paths import REPO  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("noweights")
    cfg = presets.tiny_target_dict()
    (d / "config.json").write_text(json.dumps(cfg))
    train_byte_bpe([DEMO_CORPUS], vocab_size=cfg["vocab_size"]).save(str(d / "tokenizer.json"))
    return str(d)


def sh(command: str, **env) -> subprocess.CompletedProcess:
    """`python -m jaxspec ...` through bash, which can close a stream (`2>&-`) or pipe it."""
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", **env}
    r = subprocess.run(["bash", "-c", command.replace("JAXSPEC", f"{sys.executable} -m jaxspec")], cwd=REPO,
                       env=env, capture_output=True, timeout=120)
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    return r


def test_notes_never_reach_stdout_when_stderr_is_closed(model_dir):
    """With fd 2 closed Python's sys.stderr is None, and print(file=None) writes to stdout: the
    notes (here: the budget lowered to the context, classic decoding) went among the output."""
    r = sh(f"JAXSPEC generate hi --model {model_dir} --max-tokens 100000 --devices 2 2>&-")
    assert r.returncode == 2 and r.stdout == "", r.stdout


def test_closed_stdout_is_refused_before_loading(model_dir):
    """It used to generate everything and then exit 1 ("internal error")."""
    r = sh(f"JAXSPEC generate hi --model {model_dir} >&-")
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["jaxspec: error: stdout is closed: the generated text has nowhere to go "
                                     "(redirect it to a file or /dev/null)"]


def test_a_jax_platform_that_cannot_start_is_named(model_dir):
    """JAX_PLATFORMS=cuda without the CUDA plugin: JAX raises a bare AssertionError (was exit 1)."""
    r = sh(f"JAXSPEC generate hi --model {model_dir}", JAX_PLATFORMS="cuda")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith("jaxspec: error: JAX_PLATFORMS='cuda': JAX cannot start 'cuda' on this machine")
    assert "unset JAX_PLATFORMS" in line and "internal error" not in line


def test_unsafe_compile_cache_flag(model_dir, tmp_path, capsys, monkeypatch):
    """A --compile-cache directory others can write holds files that will run as code: exit 2."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(cli, "_load_pair", lambda *a, **k: pytest.fail("models loaded"))
    assert cli.main(["generate", "hi", "--model", model_dir, "--compile-cache", str(shared)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"jaxspec: error: --compile-cache: compile cache directory {str(shared)!r} is unsafe: it is writable by "
        "others (mode 0777); what the cache holds is loaded as code, so use a directory only you can write (e.g. chmod "
        "go-w, or another directory)"]


def test_messages_are_one_line_of_bounded_length(capsys):
    rng = seeded_rng()
    words = ["".join(rng.choice(list("abcdefgh"), 7)) for _ in range(20_000)]
    huge = "\n".join(words)  # 160,000 characters over 20,000 lines

    def raises(e):
        def command(_):
            raise e
        return command

    for exc, code in ((cli.UsageError(huge), 2), (RuntimeError(huge), 1)):
        assert cli._guarded(raises(exc), None, False) == code
        [line] = capsys.readouterr().err.splitlines()
        assert len(line) <= cli.MAX_MESSAGE
        assert words[0] in line and words[-1] not in line
        left_out = len(" ".join(words)) - (line.index(" ... [") - line.index(words[0]))
        assert f" ... [{left_out} more characters]" in line
    assert line.startswith("jaxspec: internal error: RuntimeError: ")
    assert line.endswith(" (rerun with --debug for the traceback)")


def test_exit_status_rule(capsys):
    """User errors (UsageError, the library's ValueError and subclasses, NotImplementedError) are
    exit 2; any other exception is a bug, exit 1; Ctrl-C 130; a reader that closed the pipe 0."""
    cases = [(cli.UsageError("u"), 2), (ValueError("v"), 2), (TokenizerError("t"), 2),
             (NotImplementedError("n"), 2), (AssertionError(), 1), (TypeError("t"), 1), (KeyError("k"), 1),
             (KeyboardInterrupt(), 130)]
    for exc, code in cases:
        def command(_, exc=exc):
            raise exc
        assert cli._guarded(command, None, False) == code, exc
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1
        assert ("internal error" in err) == (code == 1)


def test_a_closed_pipe_ends_quietly():
    """`jaxspec ... | head -c1`: the reader leaves while the text is written; no message, exit 0,
    and nothing at exit either (the last flush of stdout's buffer)."""
    child = ("import sys; from jaxspec import cli\n"
             "def command(_):\n"
             "    for _ in range(1000): sys.stdout.write('x' * 1000); sys.stdout.flush()\n"
             "    sys.stdout.write('unflushed')\n"
             "sys.exit(cli._guarded(command, None, False))")
    r = sh(f"{sys.executable} -c \"{child}\" | head -c1 >/dev/null; echo ${{PIPESTATUS[0]}} >&2")
    assert r.stderr == "0\n" and r.stdout == ""
