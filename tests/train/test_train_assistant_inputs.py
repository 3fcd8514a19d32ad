"""`python -m jaxspec.train.assistant` on bad input (jaxspec.train.assistant_inputs): every user
mistake is one line on stderr and exit status 2, found before the target is loaded (the loader is
replaced by one that fails the test); the work folder is the user's own (under the user's cache by
default, made 0700; one someone else owns or can write, or that sits where others can replace it,
is refused before anything is read from it); a resumed run's record and arrays are checked first.
Nothing here trains: tests/test_train_assistant.py runs the recipe."""
import json
import os
import re
import stat
import time

import numpy as np
import pytest

from jaxspec.train import assistant as ta
from jaxspec.models import presets
from support.seeds import seeded_int

PREFIX = "python -m jaxspec.train.assistant: error: "


class Reached(Exception):
    """The run got past its checks: it was about to load the target."""


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny target's config.json and a weight file: all the checks read (nothing loads it here)."""
    path = tmp_path_factory.mktemp("ta_target") / "target"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(presets.tiny_target_dict(vocab_size=512)))
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return str(path)


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    def reached(*a, **kw):
        raise Reached
    monkeypatch.setattr(ta.models, "load_target", reached)


def base(target_dir, tmp_path, *extra) -> list[str]:
    """A run that passes every check (a tiny recipe); `extra` flags override (argparse: the last wins)."""
    return ["--target", target_dir, "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
            "--random-prompts", "--prompts", "32", "--gen-batch", "16", "--batch", "2", "--prompt-tokens", "16",
            "--new-tokens", "16", "--ffn", "64", "--centroids", "32", "--top-k", "4", "--no-eval", "--minutes", "5",
            *extra]


def refused(capsys, argv) -> str:
    """main(argv): exit status 2 and one `error:` line on stderr, in well under a second's work; the line."""
    t0 = time.monotonic()
    rc = ta.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(PREFIX), err
    assert time.monotonic() - t0 < 10
    return err[len(PREFIX):]


MISTAKES = [  # (extra flags, what the line says); {file}, {nope}, {empty}: paths made by the test
    (["--target", "{nope}"], r"--target '.*nope' is not a target jaxspec can load: '.*nope' does not exist"),
    (["--target", "gemma-9-zzz"], r"does not exist \(a model name is one of: gemma-3-270m\)"),
    (["--target", "{file}"], r"is not a target jaxspec can load: .* is a regular file, not a directory"),
    (["--out", "{file}"], r"--out '.*file' exists and is not a directory"),
    (["--work", "{file}"], r"--work '.*file' is not yours alone: it is not a directory"),
    (["--minutes", "0"], r"--minutes must be a number > 0, got 0.0"),
    (["--minutes", "-5"], r"--minutes must be a number > 0, got -5.0"),
    (["--minutes", "nan"], r"--minutes must be a number > 0, got nan"),
    (["--minutes", "abc"], r"argument --minutes: invalid float value: 'abc' \(--help lists the flags\)"),
    (["--minutes", "2"], r"--minutes 2 is too short: the run keeps 20 s at its end for saving and needs 120 s for "
     r"its data and training: pass at least --minutes 2.4"),
    (["--lr", "nan"], r"--lr must be a number > 0, got nan"),
    (["--weight-decay", "-1"], r"--weight-decay must be a number >= 0, got -1.0"),
    (["--self-share", "1.5"], r"--self-share must be a number in \[0, 1\], got 1.5"),
    (["--prompts", "8"], r"--prompts 8 is fewer than --gen-batch 16"),
    (["--batch", "16"], r"--prompts 32 leaves fewer than --batch 16 training rows beside the 32 kept"),
    (["--batch", "0"], r"--batch must be an integer >= 1, got 0"),
    (["--prompt-tokens", "1"], r"--prompt-tokens must be an integer >= 2, got 1"),
    (["--prompt-tokens", "250"], r"--prompt-tokens 250 \+ --new-tokens 16 = 266 positions, past the target's context"),
    (["--new-tokens", "2"], r"--new-tokens must be an integer >= 3, got 2"),
    (["--centroids", "48"], r"--centroids 48 must be 0 \(a full head\) or a power of two dividing"),
    (["--centroids", "1024"], r"--centroids 1024 must be 0 .* vocabulary of 512"),
    (["--top-k", "0"], r"--top-k must be an integer >= 1, got 0"),
    (["--layers", "0"], r"--layers must be an integer >= 1, got 0"),
    (["--seed", "-1"], r"--seed must be an integer >= 0, got -1"),
    (["--heldout", "{nope}"], r"--heldout '.*nope' is not a file"),
    (["--heldout", "{file}"], r"held-out prompts '.*file' cannot be read: Expecting value"),
    (["--target-name", "../x"], r"--target-name '../x' must be a plain name"),
    (["--resume", "--work", "{empty}"], r"--resume: '.*empty' holds no run \(run.json\)"),
]


@pytest.mark.parametrize("extra, why", MISTAKES, ids=[" ".join(m[0]) for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2_before_loading(capsys, target_dir, tmp_path, extra, why):
    (tmp_path / "file").write_text("not json, not a model")
    (tmp_path / "empty").mkdir()
    paths = {"{file}": tmp_path / "file", "{nope}": tmp_path / "nope", "{empty}": tmp_path / "empty"}
    argv = base(target_dir, tmp_path, *(str(paths.get(a, a)) for a in extra))
    err = refused(capsys, argv)
    assert re.search(why, err), (why, err)
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()  # nothing written


def test_text_prompts_need_the_targets_tokenizer(capsys, target_dir, tmp_path):
    """Held-out prompts are text: a target without a tokenizer is refused before it loads (it was a
    traceback after loading), and nothing is written."""
    held = tmp_path / "held.json"
    held.write_text(json.dumps({"prompts": [{"text": "The history of the printing press begins"}]}))
    argv = [a for a in base(target_dir, tmp_path, "--heldout", str(held)) if a != "--random-prompts"]
    err = refused(capsys, argv)
    assert err == f"--target '{target_dir}' has no tokenizer to make text prompts with (no tokenizer.json in " \
                  f"'{target_dir}'): pass --random-prompts, or a target with one"
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_the_default_work_folder_is_the_users_own(capsys, target_dir, tmp_path, monkeypatch):
    """Without --work the folder is jaxspec/drafter-work/<name> in the user's cache, made 0700 (it
    was a fixed /tmp/jaxspec-drafter-<name>, which another user could make first). One that is
    writable by others, a link, or owned by someone else is refused, and so is any --work in a
    folder others can write (they could swap it)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    argv = [a for a in base(target_dir, tmp_path, "--target-name", "tiny-" + str(seeded_int(1 << 30)))
            if a != "--work" and a != str(tmp_path / "work")]
    name = argv[-1]
    with pytest.raises(Reached):
        ta.main(argv)
    work = cache / "jaxspec" / "drafter-work" / name
    assert stat.S_IMODE(work.stat().st_mode) == 0o700 and sorted(os.listdir(work)) == ["run.json"]
    assert not os.path.exists(f"/tmp/jaxspec-drafter-{name}")
    work.chmod(0o777)
    assert "is not yours alone: it is writable by others (mode 0777)" in refused(capsys, argv)
    work.chmod(0o700)
    if os.geteuid() == 0:  # only root can give a folder away
        os.chown(work, 4242, 4242)
        assert "is not yours alone: it is owned by uid 4242" in refused(capsys, argv + ["--resume"])
        os.chown(work, 0, 0)
    work.rename(tmp_path / "elsewhere")
    work.symlink_to(tmp_path / "elsewhere")
    assert "is not yours alone: it is a symbolic link" in refused(capsys, argv)
    shared = tmp_path / "shared"
    (shared / "w").mkdir(parents=True)
    shared.chmod(0o777)
    err = refused(capsys, argv + ["--work", str(shared / "w")])
    assert f"its folder '{shared}' is writable by others (mode 0777), who could replace it" in err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    err = refused(capsys, argv + ["--work", str(tmp_path / "mine")])  # a new run clears its folder: not this one
    assert "holds files that are not a train_assistant run (notes.txt)" in err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_resumed_run_is_checked_before_loading(capsys, target_dir, tmp_path):
    """--resume follows the work folder's run.json: a damaged one, one with a value of the wrong type,
    one for another --target, and damaged cached arrays are each one line, before the target loads."""
    argv = base(target_dir, tmp_path, "--resume")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    args = ta.parse_args(base(target_dir, tmp_path))
    good = dict(args=vars(args), target="target")
    for record, why in (("{bad", "run.json' cannot be read (Expecting property name"),
                        (json.dumps(dict(good, args=dict(vars(args), lr="abc"))),
                         "--lr must be a number > 0, got 'abc'"),
                        (json.dumps(dict(good, args=dict(vars(args), surprise=1))), "is not the record of a train_"),
                        (json.dumps(dict(good, args=dict(vars(args), target="/elsewhere/model"))),
                         "trains a drafter for --target '/elsewhere/model', not"),
                        (json.dumps(dict(good, args=dict(vars(args), ffn=128))),  # this call says --ffn 64
                         "was started with --ffn 128; this call's --ffn 64 cannot change it")):
        (work / "run.json").write_text(record)
        assert why in refused(capsys, argv)
    (work / "run.json").write_text(json.dumps(good))
    rows = np.random.default_rng(seeded_int(1 << 20)).integers(3, 512, (32, 32)).astype(np.int32)
    np.savez(work / "data.npz", rows=rows, eval_prompts=np.asarray(json.dumps([[5, 6]])))
    with pytest.raises(Reached):  # a good record and good rows: on to loading
        ta.main(argv)
    capsys.readouterr()
    np.savez(work / "data.npz", rows=rows[:, :20], eval_prompts=np.asarray(json.dumps([[5, 6]])))
    assert "data.npz' is damaged (its rows are int32 (32, 20), not this run's rows of 32 tokens)" in \
        refused(capsys, argv)
    (work / "data.npz").unlink()
    (work / "ckpt.npz").write_bytes(b"PK\x03\x04" + bytes(40))  # a cut zip
    assert "ckpt.npz' is damaged (" in refused(capsys, argv)
