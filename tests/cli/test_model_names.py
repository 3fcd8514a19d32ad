"""Model names on the command line: `serve --model gemma-3-270m` answers to "gemma-3-270m" (its file's
name still accepted), an unknown name lists the names jaxspec knows, `--help` says what --model takes.

The known name resolves to a tiny GGUF named as the real package's file (models.gguf.by_name
patched), and the server is the real `jaxspec.serve.app.Server` built by `cmd_serve`, caught before
it listens (`app.serve` patched); its request parser is what answers a client's "model"."""
import json

import pytest

from jaxspec import cli
from jaxspec.models import gguf
from jaxspec.serve import app
from jaxspec.serve.protocol import ApiError
from support.cli_errors import one_line_error
from support.gguf_files import write_tiny
from support.seeds import seeded_rng

FILE = "gemma-3-270m-q4_k_m.gguf"  # the gemma3 extra's file name


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("name", ["gemma-3-1b", "google/gemma-3-270m"])
def test_an_unknown_model_name_lists_the_known_ones(capsys, command, name):
    err = one_line_error(capsys, command, *(["hi"] if command == "generate" else []), "--model", name)
    assert f"--model {name!r} does not exist, and is not a model name jaxspec knows (gemma-3-270m)" in err, err
    assert ("jaxspec downloads nothing" in err) == ("/" in name)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_says_what_model_takes(capsys, command):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model DIR|FILE.gguf|NAME" in out and "gemma-3-270m" in out


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("names") / FILE, seeded_rng())


def _served(monkeypatch, *argv) -> app.Server:
    caught = []
    monkeypatch.setattr(app, "serve", lambda srv, *a, **kw: caught.append(srv))
    assert cli.main(["serve", *argv, "--no-warmup", "--no-weights-cache"]) == 0
    return caught[0]


def _ask(srv, model):
    return srv.schema.request(json.dumps({"model": model, "prompt": "t5 t9"}).encode(), False)


def test_serve_answers_to_the_name_given_and_to_the_file_name(tiny_file, monkeypatch):
    monkeypatch.setattr(gguf, "by_name", lambda name: tiny_file)
    srv = _served(monkeypatch, "--model", "gemma-3-270m")
    assert srv.model_name == "gemma-3-270m"
    for model in ("gemma-3-270m", FILE, None):
        ids, _, _, _ = _ask(srv, model)
        assert ids[-2:] == srv.tok.encode("t5 t9")[-2:]
    with pytest.raises(ApiError) as e:
        _ask(srv, "gpt-4")
    assert e.value.status == 404 and f'serves "gemma-3-270m" (also named "{FILE}")' in e.value.body()["error"]["message"]
    by_path = _served(monkeypatch, "--model", tiny_file)  # a path: its file's name, as before
    assert by_path.model_name == FILE and _ask(by_path, FILE)
    with pytest.raises(ApiError):
        _ask(by_path, "gemma-3-270m")
