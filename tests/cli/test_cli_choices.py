"""`jaxspec generate --n N` and the penalty flags (issue 68), in process on the session's tiny pair: the
choices are printed one after another under numbered headers, each with its stats line, and choice i
is what `--seed S+i` prints alone; --json lists them."""
import json
import re

from jaxspec import cli
from support.seeds import seeded_int

FLAGS = ["--no-assistant", "--temperature", "0.9", "--repetition-penalty", "1.3", "--presence-penalty", "0.5",
         "--frequency-penalty", "0.2", "--max-tokens", "8", "--ignore-eos", "--dtype", "float32",
         "--no-compile-cache"]


def test_n_choices_are_numbered_and_each_is_its_own_seed(pair, capsys):
    target_dir, _ = pair
    seed = seeded_int(1 << 40)
    assert cli.main(["generate", "def f(x):", "--model", target_dir, *FLAGS, "--n", "3", "--seed", str(seed)]) == 0
    out = capsys.readouterr().out
    parts = re.split(r"^\[choice (\d+), seed (\d+)\]\n", out, flags=re.M)
    assert parts[0] == "" and parts[1::3] == ["0", "1", "2"] and parts[2::3] == [str(seed + i) for i in range(3)]
    texts = []
    for block in parts[3::3]:
        text, stats = block.rsplit("\n", 2)[:2]
        assert stats.startswith("stats: classic | 8 new tokens"), block
        texts.append(text)
    assert cli.main(["generate", "def f(x):", "--model", target_dir, *FLAGS, "--seed", str(seed + 2), "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["text"] == texts[2]
    assert cli.main(["generate", "def f(x):", "--model", target_dir, *FLAGS, "--n", "2", "--seed", str(seed),
                     "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [c["index"] for c in got["choices"]] == [0, 1] and [c["text"] for c in got["choices"]] == texts[:2]
    assert len(set(texts)) > 1
