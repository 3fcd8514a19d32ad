"""benchmarks/serve_guard.py: `compare` flags every row that fell by more than 5% (or `--drop`'s bar) and
checks the serving targets from the rows; `run` hands its flags to the tree's serve_bench; `prepare` writes
a commit's tree without the default pair's weights. (serve_bench's two workloads are tested in
test_serve_bench.py; on the 12B they need the GPU.)"""
import json
import os

import numpy as np
import pytest
import subprocess
import sys

from support.paths import REPO  # noqa: E402
from support.seeds import seeded_rng
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import serve_guard  # noqa: E402


def _write(d, rows, long, commit):
    for part, name, data in (("sweep", "serve.json", rows), ("long", "serve_long.json", long)):
        os.makedirs(os.path.join(d, part))
        with open(os.path.join(d, part, name), "w") as f:
            json.dump({"rows": data}, f)
    with open(os.path.join(d, "guard.json"), "w") as f:
        json.dump({"commit": commit, "repeats": True}, f)


def test_compare_flags_drops_and_reads_the_targets(tmp_path, capsys):
    rng = seeded_rng()
    keys = [(m, s, c) for m in ("engine", "http") for s in ("greedy", "mixed") for c in (1, 8, 32)]
    old = [dict(mode=m, sampling=s, clients=c, tokens_per_s=float(rng.uniform(100, 4000)), ttft_median_s=0.1,
                stream_tokens_per_s=50.0) for m, s, c in keys]
    factors = rng.uniform(0.8, 1.2, len(keys))
    factors[rng.integers(len(keys))] = 0.9  # at least one drop
    new = [dict(r, tokens_per_s=r["tokens_per_s"] * f) for r, f in zip(old, factors)]
    long = [dict(p99_ratio=float(rng.uniform(1, 5)), gap_p99_during_ms=float(rng.uniform(10, 60)),
                 long_ttft_s=float(rng.uniform(1, 4)), long_total_s=5.0)]
    _write(tmp_path / "old", old, long, "a" * 40)
    _write(tmp_path / "new", new, long, "b" * 40)
    out = tmp_path / "cmp.md"
    assert serve_guard.main(["compare", str(tmp_path / "old"), str(tmp_path / "new"), "--out", str(out)]) == 1
    text = out.read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    dropped = {k for k, f in zip(keys, factors) if f < 0.95}
    for (m, s, c), f in zip(keys, factors):
        row = next(line for line in text.splitlines() if line.startswith(f"| {m} | {s} | {c} |"))
        assert ("**drop**" in row) == ((m, s, c) in dropped), row
    http = {(r["sampling"], r["clients"]): r["tokens_per_s"] for r in new if r["mode"] == "http"}
    met = dict((t, ok) for t, _, ok in serve_guard.targets(new, long))
    assert met[serve_guard.TARGETS[0]] == (http["greedy", 32] >= 3000)
    assert met[serve_guard.TARGETS[1]] == (http["greedy", 8] >= 7 * http["greedy", 1])
    assert met[serve_guard.TARGETS[2]] == (http["mixed", 32] >= 0.85 * http["greedy", 32])
    assert met[serve_guard.TARGETS[3]] == (long[0]["p99_ratio"] <= 3 and long[0]["gap_p99_during_ms"] <= 40)
    assert met[serve_guard.TARGETS[4]] == (long[0]["long_ttft_s"] <= 2)
    # no drop: exit status 0
    assert serve_guard.main(["compare", str(tmp_path / "old"), str(tmp_path / "old")]) == 0
    # prefix reuse's 3% bar: the rows between 0.95 and 0.97 are drops too
    factors[0] = 0.96
    new = [dict(r, tokens_per_s=r["tokens_per_s"] * f) for r, f in zip(old, factors)]
    _write(tmp_path / "reuse", new, long, "b" * 40)
    capsys.readouterr()
    assert serve_guard.main(["compare", str(tmp_path / "old"), str(tmp_path / "reuse"), "--drop", "0.97"]) == 1
    text = capsys.readouterr().out
    assert "Drops over 3%:" in text
    for (m, s, c), f in zip(keys, factors):
        row = next(line for line in text.splitlines() if line.startswith(f"| {m} | {s} | {c} |"))
        assert ("**drop**" in row) == (f < 0.97), row


def test_run_hands_reuse_off_to_the_trees_serve_bench(tmp_path, capsys):
    """`run --no-prefix-cache` runs each part with reuse off and says so in guard.json, which `compare`'s
    title reads; a tree whose serve_bench has no such flag is refused before anything runs."""
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True)
    # a serve_bench that records its arguments (the flag's name appears in it, as in a tree with reuse)
    (tree / "benchmarks" / "serve_bench.py").write_text(
        "import json, os, sys  # accepts --repeats and --no-prefix-cache\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\nos.makedirs(out)\n"
        "json.dump(sys.argv[1:], open(os.path.join(out, 'argv.json'), 'w'))\n")
    commit = "%040x" % int(seeded_rng().integers(1 << 62))
    for flag, d in (([], "on"), (["--no-prefix-cache"], "off")):
        assert serve_guard.main(["run", "--tree", str(tree), "--out", str(tmp_path / d), "--commit", commit,
                                 "--parts", "sweep,long", *flag]) == 0
        for part in ("sweep", "long"):
            argv = json.loads((tmp_path / d / part / "argv.json").read_text())
            assert ("--no-prefix-cache" in argv) == bool(flag) and argv[argv.index("--commit") + 1] == commit
            assert argv[:len(serve_guard.PARTS[part][0])] == serve_guard.PARTS[part][0]
        assert json.loads((tmp_path / d / "guard.json").read_text())["prefix_cache"] == (not flag)
    # --clients: the sweep at those counts alone, the rest of its arguments the same
    assert serve_guard.main(["run", "--tree", str(tree), "--out", str(tmp_path / "c32"), "--commit", commit,
                             "--parts", "sweep", "--clients", "32"]) == 0
    argv = json.loads((tmp_path / "c32" / "sweep" / "argv.json").read_text())
    sweep = serve_guard.PARTS["sweep"][0]
    at = sweep.index("--clients") + 1
    assert argv[:len(sweep)] == sweep[:at] + ["32"] + sweep[at + 1:] and sweep[at] == "1,8,32"
    assert json.loads((tmp_path / "c32" / "guard.json").read_text())["clients"] == "32"
    with pytest.raises(SystemExit, match="--clients '8,x'"):
        serve_guard.main(["run", "--tree", str(tree), "--out", str(tmp_path / "bad"), "--clients", "8,x"])
    assert not (tmp_path / "bad").exists()
    capsys.readouterr()
    serve_guard.main(["compare", str(tmp_path / "off"), str(tmp_path / "on")])
    title = f"# serve guard: {commit[:12]} against {commit[:12]} (prefix reuse off)\n"
    assert capsys.readouterr().out.startswith(title)
    (tree / "benchmarks" / "serve_bench.py").write_text("raise SystemExit(3)  # accepts --repeats\n")
    with pytest.raises(SystemExit, match="--no-prefix-cache: .* has no such flag"):
        serve_guard.main(["run", "--tree", str(tree), "--out", str(tmp_path / "x"), "--no-prefix-cache"])
    assert not (tmp_path / "x").exists()


def test_budgets_puts_each_budget_beside_its_long_workload(tmp_path, capsys):
    rng = seeded_rng()
    budgets = sorted(int(b) for b in rng.choice(np.arange(1, 64) * 128, 3, replace=False))
    sweep = [dict(mode=m, step_tokens=b, lanes=b // 128, tokens_per_s=float(rng.uniform(100, 4000)),
                  ttft_median_s=float(rng.uniform(0.05, 0.5))) for b in budgets for m in ("engine", "http")]
    long = [dict(step_tokens=b, lanes=b // 128, gap_p99_during_ms=float(rng.uniform(10, 60)),
                 p99_ratio=float(rng.uniform(1, 5)), long_ttft_s=float(rng.uniform(1, 4))) for b in budgets[1:]]
    for part, name, rows in (("budget", "serve.json", sweep), ("budget-long", "serve_long.json", long)):
        os.makedirs(tmp_path / part)
        (tmp_path / part / name).write_text(json.dumps({"rows": rows}))
    assert serve_guard.main(["budgets", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for b in budgets:
        row = next(line for line in lines if line.startswith(f"| {b} ({b // 128}) |"))
        http = next(r for r in sweep if r["step_tokens"] == b and r["mode"] == "http")
        assert f"| {http['tokens_per_s']:.0f} | {http['ttft_median_s'] * 1e3:.0f} |" in row
        g = next((r for r in long if r["step_tokens"] == b), None)
        assert row.endswith(f"| {g['p99_ratio']:.2f}x | {g['long_ttft_s']:.2f} |" if g else "| - | - | - |"), row


def test_prepare_writes_the_tree_without_weights(tmp_path):
    dest = tmp_path / "old"
    assert serve_guard.main(["prepare", "HEAD", "--dest", str(dest)]) == 0
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert (dest / "COMMIT").read_text().strip() == head
    assert (dest / "benchmarks" / "serve_bench.py").exists() and (dest / "jaxspec" / "engine").is_dir()
    assert not list(dest.rglob("model.safetensors"))
    tracked = subprocess.run(["git", "-C", REPO, "ls-files", "*model.safetensors"],
                             capture_output=True, text=True).stdout.split()
    # the checkout has them (the default pair's, the shipped drafter's): the guard's tree left them out
    assert any("default_pair/" in t for t in tracked) and any("data/drafters/" in t for t in tracked)
