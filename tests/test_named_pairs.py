"""Named pairs (jaxspec.pairs): `jaxspec generate --pair gemma-3-270m` and `jaxspec.load_pair`.

The wiring runs on a tiny stand-in: `models.gguf.by_name` answers the tiny target's directory and
`pairs.DRAFTERS` is a folder whose gemma-3-270m/ holds the tiny assistant with the config a trained
drafter carries ("target": "gemma-3-270m"), so the CLI's and the loader's paths for the real pair
run in seconds, offline: speculative decoding with --compare (greedy identical to classic), and one
line with exit status 2 for a missing drafter, an incomplete one, one made for another target, an
unknown name. The shipped drafter on the real GGUF: tests/test_shipped_drafter.py.
"""
from support.paths import REPO  # noqa: E402
import json
import os
import re
import sys
import shutil

import pytest

import jaxspec
from jaxspec import cli, pairs
from jaxspec.models import gguf
from support.cli_errors import one_line_error

CACHE = os.environ["JAXSPEC_TEST_COMPILE_CACHE"]  # this run's, made by conftest.py
PROMPT = "def fibonacci(n):"  # tests/cli/test_cli.py's prompt, budget and pair: the same compiled programs
NAME = "gemma-3-270m"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """(tiny target dir, drafters folder) with `by_name` and `pairs.DRAFTERS` pointed at them."""
    root = tmp_path_factory.mktemp("named")
    assert cli.main(["tiny-pair", str(root / "pair")]) == 0
    drafter = root / "drafters" / NAME
    shutil.copytree(root / "pair" / "assistant", drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps(dict(cfg, target=NAME)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "by_name", lambda name: str(root / "pair" / "target"))
        mp.setattr(pairs, "DRAFTERS", str(root / "drafters"))
        yield str(root / "pair" / "target"), root / "drafters"


def _bad(capsys, *argv):
    return one_line_error(capsys, *argv)


def test_pair_name_runs_speculative_with_compare(stand_in, capsys):
    rc = cli.main(["generate", PROMPT, "--pair", NAME, "--max-tokens", "24", "--compare", "--compile-cache", CACHE])
    out, err = capsys.readouterr()
    assert rc == 0, err
    stats = out.rstrip("\n").split("\n")[-1]
    assert re.match(r"stats: speculative K=4 \| \d+ new tokens .*acceptance [\d.]+% .* [\d.]+ tokens/round .*"
                    r"speedup [\d.]+x \| greedy output identical to classic: yes$", stats), stats
    assert f"loading assistant from {stand_in[1] / NAME}" in err


def test_drafter_problems_are_one_line(stand_in, capsys, tmp_path):
    drafter = stand_in[1] / NAME
    other = tmp_path / "other"
    shutil.copytree(drafter, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, target="gemma-3-1b")))
    err = _bad(capsys, "generate", "hi", "--pair", NAME, "--assistant", str(other))
    assert f"was trained for target 'gemma-3-1b', not '{NAME}'" in err
    (other / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "target"}))
    assert "names no target" in _bad(capsys, "generate", "hi", "--pair", NAME, "--assistant", str(other))
    os.remove(other / "model.safetensors")
    assert "lacks model.safetensors" in _bad(capsys, "generate", "hi", "--pair", NAME, "--assistant", str(other))
    err = _bad(capsys, "generate", "hi", "--pair", NAME, "--assistant", str(tmp_path / "none"))
    assert f"no drafter for '{NAME}'" in err and "jaxspec.train.ttt --target gemma-3-270m" in err
    assert "neither a named pair (default, gemma-3-270m) nor a directory" in _bad(capsys, "generate", "hi",
                                                                                   "--pair", "gemma-9")
    assert "ships its own assistant" in _bad(capsys, "generate", "hi", "--pair", "default", "--assistant", str(drafter))
    with pytest.MonkeyPatch.context() as mp:  # the shipped drafter absent: the pair is refused, classic still runs
        mp.setattr(pairs, "DRAFTERS", str(tmp_path / "empty"))
        err = _bad(capsys, "generate", "hi", "--pair", NAME)
        assert f"no drafter for '{NAME}' is installed" in err and str(tmp_path / "empty" / NAME) in err
        assert f"--model {NAME} --draft ngram" in err and "--assistant DIR" in err
        assert pairs.resolve(NAME, str(drafter)).assistant == str(drafter)


def test_load_pair_generates_as_the_cli(stand_in, capsys):
    target, assistant, tok = jaxspec.load_pair(NAME)
    assert target.config.hidden_size == assistant.config.backbone_hidden_size
    ids = tok.encode(PROMPT)
    spec = jaxspec.generate(target, [ids], assistant=assistant, max_new_tokens=24, eos_token_ids=tok.eos_token_ids)
    classic = jaxspec.generate(target, [ids], max_new_tokens=24, eos_token_ids=tok.eos_token_ids)
    assert spec.tokens == classic.tokens and spec.stats.mode == "speculative"
    assert cli.main(["generate", PROMPT, "--pair", NAME, "--max-tokens", "24", "--json", "--compile-cache", CACHE]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == spec.tokens[0]
    with pytest.raises(ValueError, match="unknown pair 'nope'"):
        jaxspec.load_pair("nope")


def test_bench_resolves_the_named_pair_and_its_prompts(stand_in):
    """`speculative_bench --target gemma-3-270m`: the GGUF target (here the stand-in), the shipped
    drafter and the drafter directory's heldout_prompts.json, text tokenized with the target's
    tokenizer (the loop's per-prompt rows: tests/bench/test_speculative_bench.py)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import speculative_bench as sb
    from jaxspec.text import load_tokenizer

    texts = ["def add(a, b):", "The quick brown fox"]
    heldout = stand_in[1] / NAME / "heldout_prompts.json"
    heldout.write_text(json.dumps({"prompts": [{"kind": "code", "text": texts[0]}, {"kind": "prose", "text": texts[1]},
                                               [5, 6, 7]]}))
    try:
        args = sb.build_parser().parse_args(["--target", NAME, "--each-prompt"])
        sb.resolve_named_pair(args)
        ids, kinds = sb.text_prompts(args)
    finally:
        os.remove(heldout)
    assert (args.target, args.assistant, args.prompts) == (stand_in[0], str(stand_in[1] / NAME), str(heldout))
    tok = load_tokenizer(stand_in[0])
    assert ids == [tok.encode(texts[0]), tok.encode(texts[1]), [5, 6, 7]] and kinds == ["code", "prose", ""]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pairs, "DRAFTERS", str(stand_in[1] / "none"))
        with pytest.raises(SystemExit, match=f"--target {NAME}: no drafter for '{NAME}'"):
            sb.resolve_named_pair(sb.build_parser().parse_args(["--target", NAME]))
