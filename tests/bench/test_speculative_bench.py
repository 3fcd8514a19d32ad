"""benchmarks/speculative_bench.py end to end on CPU (XLA matmul path, tiny shapes): the report files
and their rows, greedy parity against classic decoding measured in the same process, the shipped pair
through `--target default`, and the prompt options' errors. Timings on CPU mean nothing; the rows'
structure and the parity/acceptance columns are what is checked."""
import json
import os
import sys

import pytest

from support.paths import REPO  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import speculative_bench as sb  # noqa: E402
from support.fake_terminal import Terminal  # noqa: E402
from support.hostenv import host_devices_env  # noqa: E402
from jaxspec import default_pair as dp  # noqa: E402

FAST = ["--backend", "xla", "--warmup", "0", "--repeats", "1"]


def _report(out):
    d = json.load(open(os.path.join(out, "speculative.json")))
    assert os.path.getsize(os.path.join(out, "speculative.md")) > 0
    return d["meta"], d["rows"]


@pytest.mark.slow
def test_tiny_preset_forward_loop_and_scaling(tmp_path):
    out = str(tmp_path / "o")
    sb.main(["--target", "tiny", "--runs", "forward,loop,scaling", "--k-values", "3", "--multirow", "on,off",
             "--scaling-batch", "1,2", "--max-tokens", "6", "--dtype", "float32", "--out", out, *FAST])
    meta, rows = _report(out)
    assert meta["weight_bytes"] > 0 and meta["what"].startswith("preset tiny")
    fwd = [r for r in rows if r["run"] == "forward"]
    assert {(r["multirow"], r["width"]) for r in fwd} == {(True, 1), (True, 3), (False, 1), (False, 3)}
    assert all(r["ms"] > 0 for r in fwd)
    [bit] = [r for r in rows if r["run"] == "bitwise"]
    assert bit["k"] == 3 and bit["equal"] and bit["max_abs_diff"] == 0.0
    [draft] = [r for r in rows if r["run"] == "draft"]
    assert draft["ms"] > 0
    loop = [r for r in rows if r["run"] == "loop"]
    classic = [r for r in loop if r["mode"] == "classic"]
    spec = [r for r in loop if r["mode"] == "speculative"]
    assert len(classic) == 2 and len(spec) == 2  # multirow on and off
    for r in spec:
        assert r["greedy_equal"] is True and r["k"] == 3
        assert r["round_cost"] > 0 and r["speedup"] > 0
        # the round's phases, timed apart: K - 1 draft steps at the draft row's cost, one verify
        assert r["draft_ms"] > 0 and r["verify_ms"] > 0
        assert abs(r["draft_ms"] + r["verify_ms"] + r["other_ms"] - r["round_ms"]) < 1e-6
        assert r["new_tokens"] == 6
        assert not any(key.startswith("predicted") for key in r)  # the seed's acceptances are K = 4's
    assert [r["batch"] for r in rows if r["run"] == "scaling"] == [1, 2]
    fig = sb.plot_figure(rows)  # a panel per kind of run, none empty
    assert [ax.get_title() for ax in fig.axes] == ["verify forward cost", "speculative decode loop",
                                                   "classic batched decode"]
    assert all(ax.has_data() for ax in fig.axes)


@pytest.mark.slow
@pytest.mark.skipif(not dp.default_pair_available(), reason="default pair not installed")
def test_default_pair_has_real_acceptance(tmp_path):
    out = str(tmp_path / "o")
    sb.main(["--target", "default", "--runs", "loop", "--k-values", "4", "--max-tokens", "24", "--out", out, *FAST])
    meta, rows = _report(out)
    assert meta["what"] == f"checkpoint {os.path.join(dp.default_pair_path(), 'target')}"
    [spec] = [r for r in rows if r.get("mode") == "speculative"]
    # the first held-out prompt (the bench's default prompts when --target default has none given)
    assert spec["fallback"] is None and spec["greedy_equal"] is True
    assert spec["acceptance_rate"] > 0.3 and spec["tokens_per_round"] > 1.9
    assert spec["predicted[2.90 tokens/verify]"] == pytest.approx(2.90 / spec["round_cost"])
    # the plot of a loop-only run: one panel, with the speedup in it (issue 50: the right panel was empty)
    assert os.path.getsize(os.path.join(out, "speculative.png")) > 0
    fig = sb.plot_figure(rows)
    assert [ax.get_title() for ax in fig.axes] == ["speculative decode loop"]
    [line] = [ln for ln in fig.axes[0].lines if ln.get_label().startswith("B=1")]
    assert list(line.get_xdata()) == [4] and list(line.get_ydata()) == [spec["speedup"]]


def test_prompt_text_needs_a_tokenizer(tmp_path):
    with pytest.raises(SystemExit, match="--prompt needs a tokenizer"):
        sb.main(["--target", "tiny", "--prompt", "hello", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--prompt needs a tokenizer"):
        sb.main(["--target", "tiny", "--prompt", "hello", "--tokenizer", str(tmp_path / "none.json"),
                 "--out", str(tmp_path)])


def test_exactness_probe_off_reaches_generate(tmp_path, monkeypatch):
    """--exactness-probe off: the probe is never run and K runs as asked (for the multirow-off A/B)."""
    gen = sys.modules["jaxspec.engine.generate"]  # (the package's `generate` attribute is the function)

    def no_probe(*a, **k):
        raise AssertionError("the exactness probe ran")

    monkeypatch.setattr(gen.verify, "exactness_probe", no_probe)
    out = str(tmp_path / "o")
    sb.main(["--target", "tiny", "--runs", "loop", "--k-values", "3", "--multirow", "off", "--exactness-probe", "off",
             "--max-tokens", "6", "--dtype", "float32", "--out", out, *FAST])
    [spec] = [r for r in _report(out)[1] if r.get("mode") == "speculative"]
    assert spec["k_run"] == 3 and spec["fallback"] is None and spec["new_tokens"] == 6


def test_each_prompt_sums_single_prompt_runs(tmp_path, monkeypatch, capsys):
    """--each-prompt decodes every prompt alone and sums: tokens and rounds add up over the prompts, and
    parity is counted per prompt. The models' DispatchConfig is DispatchConfig.from_env() with
    --backend applied, built once and recorded. (On a terminal's stderr, which gets the prompts'
    progress bars; stdout only the results.)"""
    monkeypatch.setenv("JAXSPEC_QMM_DENSE_ROWS", "0")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[5, 6, 7, 8]\n[9, 10, 11, 12, 13, 14, 15]\n[3, 4]\n")
    out = str(tmp_path / "o")
    term, err = Terminal(), sys.stderr
    monkeypatch.setattr(sys, "stderr", term)
    sb.main(["--target", "tiny", "--runs", "loop", "--k-values", "3", "--prompts-file", str(prompts), "--each-prompt",
             "--max-tokens", "5", "--dtype", "float32", "--out", out, *FAST])
    monkeypatch.setattr(sys, "stderr", err)
    assert "classic prompts" in term.getvalue() and "K=3 prompts" in term.getvalue()
    assert "\r" not in capsys.readouterr().out
    meta, rows = _report(out)
    assert meta["matmul"]["backend"] == "xla" and meta["matmul"]["qmm_dense_rows"] == 0
    [classic] = [r for r in rows if r.get("mode") == "classic"]
    [spec] = [r for r in rows if r.get("mode") == "speculative"]
    for r in (classic, spec):
        assert r["prompts"] == 3 and r["new_tokens"] == 3 * 5
    assert classic["rounds"] == 3 * 4  # classic: one round per token after the prefill's first
    assert spec["greedy_equal"] is True and spec["greedy_equal_prompts"] == "3/3"
    assert sum(spec["hist"]) == spec["rounds"] >= 3  # B = 1: one row-round per round, every prompt ran
    # each prompt's own row: its parity, rounds and counts, which add up to the summed row; per-position
    # acceptance from the loop's counts (GenerationStats.position_accepted), the histogram's suffix sums
    per = spec["per_prompt"]
    assert [p["prompt"] for p in per] == [0, 1, 2] and all(p["greedy_equal"] for p in per)
    assert sum(p["rounds"] for p in per) == spec["rounds"] and sum(p["new_tokens"] for p in per) == 15
    assert [sum(c) for c in zip(*(p["position_accepted"] for p in per))] == spec["position_accepted"]
    assert spec["position_accepted"] == [sum(spec["hist"][i:]) for i in (1, 2)]
    assert spec["acceptance_length"] == pytest.approx(1 + sum(p["accepted"] for p in per) / spec["rounds"])
    assert "### K = 3, each prompt alone" in open(os.path.join(out, "speculative.md")).read()
    with pytest.raises(SystemExit):
        sb.main(["--target", "tiny", "--each-prompt", "--batch", "2", "--out", out])


def test_draft_loop_chains_draft_steps():
    """draft_loop's program equals models.draft_step chained by hand: each step's argmax is the next token."""
    import jax
    import jax.numpy as jnp
    from jaxspec import models
    from harness import random_pair
    from jaxspec.kernels import DispatchConfig
    target, assistant = random_pair("tiny", "tiny", matmul=DispatchConfig(backend="xla"), seed=3, dtype=jnp.float32)
    run, args = sb.draft_loop(assistant, target, 2, steps=3)
    tok, h = run(*args)
    _, _, cache, t, hh = args
    step = jax.jit(models.draft_step)
    for _ in range(3):
        logits, hh = step(assistant, target, cache, t, hh, cache.lengths)
        t = jnp.argmax(logits, -1).astype(jnp.int32)
    assert jnp.array_equal(tok, t) and jnp.allclose(h, hh, atol=1e-5)


def test_devices_must_be_the_process_device_count(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sb.main(["--target", "tiny", "--devices", "2", "--out", str(tmp_path / "o"), *FAST])
    assert "--devices 2: this process has 1 devices" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")  # refused before any work


@pytest.mark.slow
def test_devices_splits_the_pair_on_two_host_devices(tmp_path):
    """`--devices 2` in a process with two CPU devices: both models split (models.shard), and the
    verify's bitwise check and the draft row hold on the mesh (the loop on a mesh: test_shard)."""
    import subprocess
    env = host_devices_env(2, PYTHONPATH=REPO)
    out = str(tmp_path / "o")
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "speculative_bench.py"), "--target", "tiny",
                        "--runs", "forward", "--k-values", "3", "--dtype", "float32",
                        "--devices", "2", "--out", out, *FAST], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    meta, rows = _report(out)
    assert meta["what"].endswith("split over 2 devices") and meta["args"]["devices"] == 2
    [bit] = [x for x in rows if x["run"] == "bitwise"]
    assert bit["equal"] and bit["max_abs_diff"] == 0.0
    [draft] = [x for x in rows if x["run"] == "draft"]
    assert draft["ms"] > 0
