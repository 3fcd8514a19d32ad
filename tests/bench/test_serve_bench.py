"""benchmarks/serve_bench.py end to end on CPU (tiny random pair, XLA matmuls): closed-loop clients
against the batching engine, the report's rows (every request served, K after the probe, TTFT and
per-stream rates present). Timings on CPU mean nothing; the structure and counts are checked."""
import json
import os
import sys

from support.paths import REPO  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import serve_bench  # noqa: E402
from support.fake_terminal import Terminal  # noqa: E402


def test_tiny_pair_clients_and_block_sizes(tmp_path, monkeypatch, capsys):
    """(On a terminal's stderr, which gets the sweep's progress bar; stdout only the result lines.)"""
    out = str(tmp_path / "o")
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    serve_bench.main(["--target", "tiny", "--assistant", "tiny", "--layers", "2", "--clients", "1,3",
                      "--k-values", "1,3", "--max-tokens", "6", "--capacity", "64", "--prompt-len", "20",
                      "--requests-per-client", "2", "--repeats", "2", "--backend", "xla", "--out", out])
    monkeypatch.undo()
    assert "configurations" in term.getvalue() and "4/4" in term.getvalue()
    stdout = capsys.readouterr().out
    assert "\r" not in stdout and "configurations" not in stdout and stdout.count("engine greedy K=") == 4
    d = json.load(open(os.path.join(out, "serve.json")))
    rows = d["rows"]
    assert [(r["k_asked"], r["clients"], r["slots"]) for r in rows] == [(1, 1, 1), (1, 3, 3), (3, 1, 1), (3, 3, 3)]
    for r in rows:
        assert r["requests"] == 2 * r["clients"] and r["tokens"] == 6 * r["requests"]  # no stop ids: full budgets
        assert r["k"] == r["k_asked"] and r["tokens_per_s"] > 0 and r["ttft_p90_s"] >= r["ttft_median_s"] > 0
        assert r["stream_tokens_per_s"] > 0
        assert r["prefix_hit_tokens"] == 0  # a fresh prompt a request: the sweep measures no reuse
        assert len(r["repeats_tokens_per_s"]) == 2 and r["tokens_per_s"] == max(r["repeats_tokens_per_s"])  # median of 2: the upper
    md = open(os.path.join(out, "serve.md")).read()
    assert "| engine | greedy | 3 | 3 | 3 | 3 |" in md and "speculative / classic" in md


def test_http_rows_match_the_engine_rows(tmp_path, monkeypatch):
    """--http on a preset (ids as text): every request also served over HTTP with the same token
    count as through the engine, greedy and with 16 mixed settings in one batch; mixed is
    reported against uniform. (--quiet: no progress bar, on a terminal too.)"""
    out = str(tmp_path / "o")
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    serve_bench.main(["--target", "tiny", "--assistant", "tiny", "--layers", "2", "--http", "--clients", "3",
                      "--k-values", "3", "--max-tokens", "5", "--capacity", "64", "--prompt-len", "12",
                      "--requests-per-client", "2", "--sampling", "uniform,mixed", "--backend", "xla", "--out", out,
                      "--quiet"])
    monkeypatch.undo()
    assert "configurations" not in term.getvalue() and "\r" not in term.getvalue()
    rows = json.load(open(os.path.join(out, "serve.json")))["rows"]
    assert [(r["mode"], r["sampling"]) for r in rows] == [("engine", "uniform"), ("http", "uniform"),
                                                          ("engine", "mixed"), ("http", "mixed")]
    for r in rows:
        assert r["requests"] == 6 and r["tokens"] == 30 and r["k"] == 3 and r["tokens_per_s"] > 0
        assert sum(r["steps_per_program"][1:]) > 0 and r["steps_per_program"][0] == 0  # sampled: not the greedy program
    md = open(os.path.join(out, "serve.md")).read()
    assert "| http | mixed | 3 | 3 | 3 | 3 |" in md


def test_long_request_workload(tmp_path):
    """--long-prompt: streams (staggered), then a long prompt prefilled in chunks between their steps;
    the long request completes with its whole budget and the report has gaps and the streams' TTFT
    before and while it ran, and the largest gaps while it ran (largest first)."""
    out = str(tmp_path / "long")
    serve_bench.main(["--target", "tiny", "--assistant", "tiny", "--layers", "2", "--long-prompt", "200",
                      "--long-tokens", "5", "--clients", "2", "--prompt-len", "12", "--max-tokens", "6",
                      "--k-values", "1", "--prefill-chunk", "32", "--baseline-s", "0.5", "--backend", "xla",
                      "--step-tokens", "112", "--out", out])
    r, = json.load(open(os.path.join(out, "serve_long.json")))["rows"]
    assert r["step_tokens"] == 112 and r["lanes"] == (112 - 3 * 1 * 1) // 32  # first 3 slots x 1 round x 1 token (K = 1)
    assert r["long_tokens"] == 5 and r["chunks"] >= 2 * 7  # the warm-up's long prompt and the measured one
    assert r["gaps_before"] > 0 and r["gaps_during"] > 0 and r["long_total_s"] >= r["long_ttft_s"] > 0
    assert r["short_requests_before"] > 0 and r["short_ttft_max_before_ms"] >= r["short_ttft_p50_before_ms"] > 0
    top = r["top_gaps_during"]
    assert 0 < len(top) <= min(20, r["gaps_during"]) and [g["gap_ms"] for g in top] == sorted(
        (g["gap_ms"] for g in top), reverse=True)
    assert all(0 <= g["t_s"] <= r["long_total_s"] and g["client"] in (0, 1) and g["chunks"] >= g["long_chunk"]
               for g in top)
    md = open(os.path.join(out, "serve_long.md")).read()
    assert "--long-prompt 200" in md and "short TTFT during p50 / max ms" in md
