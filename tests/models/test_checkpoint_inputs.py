"""What the loaders accept (issue 41, cases 1-3): they open only regular files, checked without
blocking; permission errors, symlink loops, FIFOs and directories are named as what they are, with
the path; a dtype the models cannot run in is refused at the call. The CLI reports each as one line,
exit status 2. Nothing here compiles a model."""
import json
import os
import shutil
import stat
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxspec import models
from jaxspec import cli
from jaxspec.text.tokenizer import Tokenizer, TokenizerError, train_byte_bpe
from jaxspec.models import presets
from support.seeds import seeded_rng

TDICT = presets.tiny_target_dict()


@pytest.fixture
def ckpt(tmp_path):
    """A model directory the CLI's up-front checks accept: config.json, a weight file, tokenizer files
    (the tensors are random and not a full model: these tests stop before any tensor is read)."""
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TDICT))
    save_file({"model.norm.weight": seeded_rng().standard_normal(64).astype(np.float32)},
              str(path / "model.safetensors"))
    train_byte_bpe(["fresh " + str(seeded_rng().integers(1 << 30))], vocab_size=260).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return path


def permission_bits_apply(tmp_path) -> bool:
    """False where permission bits do not stop this process (root with CAP_DAC_OVERRIDE)."""
    probe = tmp_path / "probe"
    probe.write_text("x")
    probe.chmod(0)
    try:
        open(probe).close()
        return False
    except PermissionError:
        return True
    finally:
        probe.chmod(0o600)


needs_permissions = pytest.mark.usefixtures("skip_unless_permission_bits_apply")


@pytest.fixture
def skip_unless_permission_bits_apply(tmp_path):
    if not permission_bits_apply(tmp_path):
        pytest.skip("this process ignores permission bits (root): an unreadable file is readable to it")


def returns_within(fn, fifo, timeout=5.0):
    """fn()'s result or error, failing the test if it blocked opening the FIFO for `timeout` s. The
    loader may block inside native code holding the GIL, so the rescue is another process: after
    `timeout` it keeps opening the FIFO for writing, which frees a blocked reader (EOF)."""
    rescue = subprocess.Popen(["sh", "-c", f'sleep {timeout}; while :; do : > "$0"; sleep 0.05; done', str(fifo)])
    t0 = time.monotonic()
    out = {}
    try:
        out["value"] = fn()
    except Exception as e:  # noqa: BLE001 (handed to the test)
        out["error"] = e
    finally:
        rescue.kill()
        rescue.wait()
    if time.monotonic() - t0 >= timeout:
        pytest.fail(f"blocked for {timeout}s opening the FIFO {fifo} (then got {out})")
    return out


def cli_error(capsys, *argv) -> str:
    """The CLI's one error line for `jaxspec generate` on the given arguments (exit status 2)."""
    assert cli.main(["generate", "hi", "--no-compile-cache", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxspec: error: ") and len(err) < 400, err
    return err


# ---- case 1: a FIFO never blocks a loader ------------------------------------------------------
def _load_model(path):
    return models.load_target(str(path))


def _load_tokenizer(path):
    return Tokenizer.from_dir(str(path))


@pytest.mark.parametrize("load,error,name", [
    (_load_model, ValueError, "model.safetensors"), (_load_model, ValueError, "config.json"),
    (_load_tokenizer, TokenizerError, "tokenizer.json"), (_load_tokenizer, TokenizerError, "tokenizer_config.json"),
    (_load_tokenizer, TokenizerError, "config.json")])
def test_a_fifo_is_refused_without_blocking(ckpt, load, error, name):
    """The model loader and the tokenizer's: a FIFO where a file belongs is named, never opened."""
    os.remove(ckpt / name)
    os.mkfifo(ckpt / name)
    out = returns_within(lambda: load(ckpt), ckpt / name)
    assert isinstance(out.get("error"), error), out
    assert f"{ckpt / name}' is a FIFO, not a regular file" in str(out["error"])


def test_cli_names_a_fifo_config(ckpt, capsys):
    os.remove(ckpt / "config.json")
    os.mkfifo(ckpt / "config.json")
    assert "config.json' is a FIFO, not a regular file" in cli_error(capsys, "--model", str(ckpt))


# ---- case 2: permissions and symlink loops are named as such -----------------------------------
def _loop(path):
    """`path` made a symlink to itself (opening it: ELOOP)."""
    if os.path.lexists(path):
        os.remove(path) if not os.path.isdir(path) or os.path.islink(path) else shutil.rmtree(path)
    os.symlink(os.path.basename(path), path)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "."])
def test_symlink_loops_are_named(ckpt, tmp_path, capsys, name):
    target = tmp_path / "loop" if name == "." else ckpt / name
    _loop(target)
    model_dir = target if name == "." else ckpt
    with pytest.raises(ValueError, match=f"'{target}' is a symlink loop"):
        models.load_target(str(model_dir))
    assert f"'{target}' is a symlink loop" in cli_error(capsys, "--model", str(model_dir), "--no-assistant")


@needs_permissions
@pytest.mark.parametrize("what", ["weights", "config", "directory"])
def test_permission_errors_are_named(ckpt, capsys, what):
    target = {"weights": ckpt / "model.safetensors", "config": ckpt / "config.json", "directory": ckpt}[what]
    target.chmod(0)
    try:
        with pytest.raises(ValueError, match=f"permission denied: cannot read '{target}'"):
            models.load_target(str(ckpt))
        assert f"permission denied: cannot read '{target}'" in cli_error(capsys, "--model", str(ckpt),
                                                                         "--no-assistant")
    finally:
        target.chmod(0o700 if what == "directory" else 0o600)


@needs_permissions
def test_unreadable_tokenizer_file_is_a_permission_error(ckpt):
    (ckpt / "tokenizer_config.json").chmod(0)
    with pytest.raises(TokenizerError, match=f"permission denied: cannot read '{ckpt / 'tokenizer_config.json'}'"):
        Tokenizer.from_dir(str(ckpt))


def test_a_directory_where_a_file_belongs_is_named(ckpt):
    os.remove(ckpt / "model.safetensors")
    os.mkdir(ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=f"'{ckpt / 'model.safetensors'}' is a directory, not a regular file"):
        models.load_target(str(ckpt))
    assert stat.S_ISDIR(os.stat(ckpt / "model.safetensors").st_mode)


# ---- case 3: a dtype the models do not run in ----------------------------------------------------
@pytest.mark.parametrize("dtype", ["int32", "uint8", "bool", "float64", "complex64", None, "no-such-type"])
@pytest.mark.parametrize("load", [models.load_target, models.load_assistant])
def test_a_dtype_the_models_cannot_run_in_is_refused_before_reading(tmp_path, load, dtype):
    """Refused at the call: the path does not even exist, and the error is about the dtype."""
    with pytest.raises(ValueError, match=rf"dtype={dtype!r} is not supported: load in bfloat16, float16 or float32"):
        load(str(tmp_path / "nowhere"), dtype=dtype)


def test_cli_memory_estimate_counts_only_the_files_the_loader_reads(ckpt):
    """The CLI's weight-bytes estimate: the index's files only (a foreign model*.safetensors beside
    an index is not read, so not counted); a symlink loop among them is a named ValueError."""
    big = int(seeded_rng().integers(5000, 9000))
    save_file({"x": np.zeros(big, np.float32)}, str(ckpt / "model_old_version.safetensors"))
    assert cli._dir_bytes(str(ckpt)) == os.path.getsize(ckpt / "model.safetensors") + os.path.getsize(
        ckpt / "model_old_version.safetensors")  # no index: model*.safetensors, as the loader reads
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight":
                                                                                  "model.safetensors"}}))
    assert cli._dir_bytes(str(ckpt)) == os.path.getsize(ckpt / "model.safetensors")
    os.remove(ckpt / "model.safetensors")
    os.symlink("model.safetensors", ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="symlink loop"):
        cli._dir_bytes(str(ckpt))
