"""The `jaxspec` CLI end to end on CPU (a tiny random pair written by `jaxspec tiny-pair`, run as
`python -m jaxspec` subprocesses): text + stats line, --compare, streamed == non-streamed, the
default pair's layout, bad input (one line, exit status 2, no traceback unless --debug), the compile
cache flags; plus the tokenizer helpers.

Compiled programs go to the test run's compilation cache (--compile-cache; made by conftest.py and
shared with tests/test_notebook.py, same tiny shapes), so a program compiles once per run.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from jaxspec import cli
from jaxspec.engine import memory as serve_memory
from jaxspec.text.tokenizer import IncrementalDecoder, Tokenizer, render_chat_template, train_byte_bpe
from jaxspec.text import load_tokenizer
from support.cli_errors import one_line_error
from support.cli_run import CACHE, run_cli  # noqa: F401

from support.paths import REPO  # noqa: E402
PROMPT = "def fibonacci(n):"
MAX_TOKENS = "24"
STATS = re.compile(r"^stats: speculative K=4 \| (\d+) new tokens \| decode [\d.]+ tok/s \| acceptance [\d.]+% \| "
                   r"mean accepted length [\d.]+ \| [\d.]+ tokens/round \| .*\| classic [\d.]+ tok/s \| "
                   r"speedup [\d.]+x \| greedy output identical to classic: yes$")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pair"))
    assert cli.main(["tiny-pair", root]) == 0
    return os.path.join(root, "target"), os.path.join(root, "assistant")


def gen_args(pair, *extra):
    return ("generate", PROMPT, "--model", pair[0], "--assistant", pair[1], "--max-tokens", MAX_TOKENS,
            "--compile-cache", CACHE, *extra)


# ---- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(pair):
    """The non-streamed run, as JSON (tokens, text, stats, the classic comparison)."""
    r = run_cli(*gen_args(pair, "--compare", "--json"))
    assert r.returncode == 0, r.stderr
    # the first-call pause is announced (compiled, or loaded whole from the run's on-disk cache), with its time
    assert re.search(r"^jaxspec: (compiled|loaded) \d programs? \(.*\) (from the on-disk cache )?in [\d.]+ s$",
                     r.stderr, re.M) and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def test_generate_json(plain):
    assert plain["streamed"] is False
    assert 1 <= len(plain["tokens"]) <= int(MAX_TOKENS) and plain["text"]
    assert plain["stats"]["mode"] == "speculative" and plain["stats"]["block_size"] == 4
    assert plain["identical_to_classic"] is True and plain["classic"]["tokens"] == plain["tokens"]
    assert plain["speedup"] > 0


def test_stream_prints_text_then_stats_line(pair, plain):
    r = run_cli(*gen_args(pair, "--stream", "--compare"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.rstrip("\n").split("\n")
    assert "\n".join(lines[:-1]) == plain["text"]  # streamed text == non-streamed text
    m = STATS.match(lines[-1])
    assert m, lines[-1]
    assert int(m.group(1)) == len(plain["tokens"])
    assert "Traceback" not in r.stderr


def test_streamed_tokens_equal_non_streamed(pair, plain):
    r = run_cli(*gen_args(pair, "--json", "--stream", "--stream-rounds", "2"))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["streamed"] is True
    assert s["tokens"] == plain["tokens"] and s["text"] == plain["text"]
    for key in ("accepted_hist", "rounds", "accepted", "drafted", "new_tokens"):
        assert s["stats"][key] == plain["stats"][key], key


def test_default_pair_layout(pair, plain, tmp_path, capsys):
    """Without --model the default pair's layout is used: PAIR/{target,assistant} with one shared
    PAIR/tokenizer.json (jaxspec.default_pair); --pair names such a directory, by default the
    packaged one."""
    root = tmp_path / "default_pair"
    shutil.copytree(pair[0], root / "target")
    shutil.copytree(pair[1], root / "assistant")
    os.replace(root / "target" / "tokenizer.json", root / "tokenizer.json")
    assert cli.default_pair_dirs(str(root)) == (str(root / "target"), str(root / "assistant"))
    assert load_tokenizer(str(root / "target")).eos_token_ids == (1,)
    r = run_cli("generate", PROMPT, "--pair", str(root), "--max-tokens", MAX_TOKENS, "--compile-cache", CACHE,
                "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == plain["tokens"]
    from jaxspec import default_pair
    packaged = cli.default_pair_dirs()
    assert packaged is None or packaged[0] == os.path.join(default_pair.default_pair_path(), "target")
    os.remove(root / "tokenizer.json")
    err = _bad(capsys, "generate", "hi", "--pair", str(root))
    assert "is not a model pair: it lacks tokenizer.json" in err
    assert "exclude each other" in _bad(capsys, "generate", "hi", "--pair", str(root), "--model", pair[0])


def test_compile_cache_flags(pair, tmp_path):
    """--compile-cache DIR fills DIR; --no-compile-cache leaves it alone; JAX's own cache setting
    wins over the flag."""
    cache = tmp_path / "cache"
    args = ("generate", "x", "--model", pair[0], "--max-tokens", "2", "--json")
    r = run_cli(*args, "--compile-cache", str(cache), "--no-compile-cache")
    assert r.returncode == 0, r.stderr
    assert not cache.exists() and "on-disk compile cache" not in r.stderr
    r = run_cli(*args, "--compile-cache", str(cache))
    assert r.returncode == 0, r.stderr
    assert any(cache.iterdir()) and "on-disk compile cache" in r.stderr
    own = tmp_path / "jax_own"
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(own))
    code = ("import jax; from jaxspec.engine import compile_cache; "
            f"print(compile_cache.enable({str(cache)!r}), jax.config.jax_compilation_cache_dir)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(own), str(own)]


# ---- bad input: one line, exit status 2 --------------------------------------------------------
def _bad(capsys, *argv):
    return one_line_error(capsys, *argv)


def test_missing_model_dir(capsys, tmp_path):
    err = _bad(capsys, "generate", "hi", "--model", str(tmp_path / "nope"))
    assert "does not exist" in err


def test_not_a_model_dir(capsys, tmp_path, pair):
    assert "no config.json" in _bad(capsys, "generate", "hi", "--model", str(tmp_path))
    # an assistant passed as the target
    err = _bad(capsys, "generate", "hi", "--model", pair[1])
    assert "not a usable Gemma 4 target" in err and "assistant" in err
    # a model directory without its weights: the loader finds it, before anything is compiled
    t = tmp_path / "t"
    shutil.copytree(pair[0], t)
    for f in t.glob("*.safetensors"):
        f.unlink()
    assert cli.main(["generate", "hi", "--model", str(t), "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "compiling" not in err
    assert err.strip().splitlines()[-1] == (f"jaxspec: error: cannot load the target from {str(t)!r}: "
                                            f"no *.safetensors files in {str(t)!r}")


def test_assistant_for_another_target(capsys, tmp_path, pair):
    other = tmp_path / "other"
    shutil.copytree(pair[1], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["backbone_hidden_size"] = 128
    (other / "config.json").write_text(json.dumps(cfg))
    err = _bad(capsys, "generate", "hi", "--model", pair[0], "--assistant", str(other))
    assert "different target" in err and "backbone_hidden_size=128" in err


def test_prompt_longer_than_context(capsys, pair):
    err = _bad(capsys, "generate", "lorem ipsum dolor " * 200, "--model", pair[0], "--assistant", pair[1])
    assert "longer than the model's context of 256 tokens" in err


def test_usage_error(capsys):
    assert cli.main(["generate"]) == 2  # argparse: the prompt is missing
    assert "usage:" in capsys.readouterr().err


def test_no_default_pair(capsys, monkeypatch):
    from jaxspec import default_pair
    monkeypatch.setattr(default_pair, "default_pair_available", lambda path=None: False)
    err = _bad(capsys, "generate", "hi")
    assert "no model given and the embedded default pair is not installed: pass --model DIR" in err


def test_bad_sampling_and_missing_tokenizer(capsys, tmp_path, pair):
    assert "temperature" in _bad(capsys, *gen_args(pair, "--temperature", "-1"))
    assert "top_p" in _bad(capsys, *gen_args(pair, "--temperature", "0.5", "--top-p", "1.5"))
    assert "does not exist" in _bad(capsys, *gen_args(pair, "--tokenizer", str(tmp_path / "none.json")))
    t = tmp_path / "t"
    shutil.copytree(pair[0], t)
    os.remove(t / "tokenizer.json")
    assert "no tokenizer.json" in _bad(capsys, "generate", "hi", "--model", str(t))


def test_real_exit_code_and_debug_traceback(tmp_path):
    r = run_cli("generate", "hi", "--model", str(tmp_path / "nope"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"jaxspec: error: --model {str(tmp_path / 'nope')!r} does not exist, and is "
                                             "not a model name jaxspec knows (gemma-3-270m): pass a model directory, "
                                             "a .gguf file or one of those names"]
    r = run_cli("generate", "hi", "--model", str(tmp_path / "nope"), "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_bad_seed_before_loading(capsys, pair):
    """Seeds outside [0, 2**64) are exit 2 before anything is loaded (jax.random.key alone would
    reduce them mod 2**32 or overflow)."""
    for seed in ("-1", str(2**64)):
        err = _bad(capsys, *gen_args(pair, "--seed", seed))
        assert f"seed must be an integer in [0, 2**64) (0 .. {2**64 - 1}), got {seed}" in err


def test_max_tokens_beyond_memory(capsys, tmp_path, pair, monkeypatch):
    """A --max-tokens whose run cannot fit the device's memory is exit 2 naming the terms,
    before loading or compiling (the model here has no max_position_embeddings to lower it to)."""
    t = tmp_path / "t"
    shutil.copytree(pair[0], t)
    cfg = json.loads((t / "config.json").read_text())
    cfg.pop("max_position_embeddings")
    (t / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(serve_memory, "available_now", lambda: None)  # the same limit for both reads below
    t0 = time.perf_counter()
    err = _bad(capsys, "generate", "hi", "--model", str(t), "--max-tokens", "1000000000")
    assert time.perf_counter() - t0 < 2.0
    mem, what, _ = cli.memory_limit()
    assert re.search(r"--max-tokens 1000000000 needs about [\d.]+ GiB: KV cache [\d.]+ GiB \(1000000\d+ positions\), "
                     r"step temporaries [\d.]+ GiB, .*; more than the " + re.escape(cli._fmt_bytes(mem)) + " of " + re.escape(what) +
                     ": lower --max-tokens", err), err
    assert cli.cache_capacity(3, 500, 4) == 576  # 16 + 512 - 1 + 4, rounded to 64
    # on a smaller device a moderate budget is refused as well, also where the context allows it
    monkeypatch.setattr(cli, "device_memory", lambda: (350 << 10, "GPU memory"))  # the tiny pair: ~470 KiB at 200
    err = _bad(capsys, *gen_args(pair, "--max-tokens", "200"))
    assert "more than the 350.0 KiB of GPU memory: lower --max-tokens" in err
    # the terms the old check left out: on a CPU the weights count 3x and the process 1.5 GiB
    monkeypatch.setattr(cli, "device_memory", lambda: (1 << 30, "host memory"))
    err = _bad(capsys, *gen_args(pair, "--max-tokens", "2"))
    assert "runtime and compiler 1.5 GiB" in err and "even one new token does not fit" in err


def test_prompt_not_utf8(tmp_path, pair):
    """A prompt that is not valid UTF-8, as an argument (its bytes arrive surrogate-escaped) or on
    stdin, is one line and exit 2, before loading."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", "jaxspec", "generate"]
    r = subprocess.run(args + [b"ab\xffc", "--model", pair[0]], cwd=REPO, env=env, capture_output=True, timeout=120)
    assert r.returncode == 2 and r.stderr.decode().strip().splitlines() == [
        "jaxspec: error: the prompt (argument) is not valid UTF-8: byte 0xff at character 2"]
    r = subprocess.run(args + ["-", "--model", pair[0]], input=b"hello \xfe", cwd=REPO, env=env,
                       capture_output=True, timeout=120)
    assert r.returncode == 2 and r.stderr.decode().strip().splitlines() == [
        "jaxspec: error: the prompt (stdin) is not valid UTF-8: byte 0xfe at offset 6"]


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_unreadable_weights(capsys, tmp_path, pair, damage):
    """An empty or truncated model.safetensors is exit 2 naming the file, on a line of its own (the
    "loading target ..." line is ended first), before anything is compiled."""
    t = tmp_path / "t"
    shutil.copytree(pair[0], t)
    f = t / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"" if damage == "empty" else data[:len(data) // 2])
    assert cli.main(["generate", "hi", "--model", str(t), "--no-compile-cache"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-2].startswith("loading target from ") and lines[-2].endswith(" ...")
    assert lines[-1].startswith(f"jaxspec: error: cannot load the target from {str(t)!r}: ")
    assert "'model.safetensors'" in lines[-1] and "compiling" not in "".join(lines)


def test_loader_errors_on_a_line_of_their_own(capsys, tmp_path, pair, monkeypatch):
    """Whatever the loader raises ends the progress line first: its ValueError (bad input, naming
    the file) is exit 2; anything else, e.g. an error the loader should have mapped, exit 1."""
    from jaxspec import models
    t = tmp_path / "t"
    shutil.copytree(pair[0], t)

    def refuse(path, **kw):
        raise ValueError(f"checkpoint {path!r} is not loadable: 'model.safetensors' is truncated")
    monkeypatch.setattr(models, "load_target", refuse)
    assert cli.main(["generate", "hi", "--model", str(t), "--no-compile-cache"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-2].endswith(" ...")
    assert lines[-1].startswith(f"jaxspec: error: cannot load the target from {str(t)!r}: checkpoint ")
    assert lines[-1].endswith("'model.safetensors' is truncated")

    def boom(path, **kw):
        raise RuntimeError("boom")
    monkeypatch.setattr(models, "load_target", boom)
    assert cli.main(["generate", "hi", "--model", str(t), "--no-compile-cache"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-2].endswith(" ...") and lines[-1].startswith("jaxspec: internal error: RuntimeError: boom")


def test_block_size_1_is_announced_as_classic(pair):
    r = run_cli(*gen_args(pair, "--block-size", "1", "--max-tokens", "4"))
    assert r.returncode == 0, r.stderr
    assert "running the classic decode loop" in r.stderr and "speculative" not in r.stderr
    stats = r.stdout.strip().splitlines()[-1]
    assert stats.startswith("stats: classic | ") and stats.endswith(" | block_size=1: nothing to draft"), stats


# ---- tokenizer ---------------------------------------------------------------------------------
def test_tokenizer_files_and_incremental_decode(pair, tmp_path):
    tok = load_tokenizer(pair[0])
    assert tok.eos_token_ids == (1,) and not tok.has_chat_template
    ids = tok.encode("héllo wörld ☃ 日本語 def f(x):")
    assert ids[0] == 2  # BOS from tokenizer.json's post-processor
    assert tok.decode(ids) == "héllo wörld ☃ 日本語 def f(x):"
    dec = IncrementalDecoder(tok)
    pieces = [dec.push([i]) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # multi-byte characters are never split


def test_chat_template(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    backend = train_byte_bpe(["some text for a tiny tokenizer <start_of_turn> <end_of_turn>"], vocab_size=300)
    tok = Tokenizer(backend, special_tokens={"bos_token": "<bos>"}, chat_template=template)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode_chat("Hi")
    assert ids.count(2) == 1 and ids[0] == 2  # BOS once (from the template, not the post-processor)
    # the template files a model directory may carry
    d = tmp_path / "m"
    d.mkdir()
    backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<bos>"}, "chat_template": template}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    tok = load_tokenizer(str(d))
    assert tok.has_chat_template and tok.eos_token_ids == (1, 7)
    (d / "chat_template.jinja").write_text("{{ raise_exception('no') }}")
    with pytest.raises(ValueError, match="chat template error: no"):
        load_tokenizer(str(d)).apply_chat_template([])
    assert render_chat_template("{{ x | tojson }}", [], x={"a": 1}) == '{"a": 1}'
