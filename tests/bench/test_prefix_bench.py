"""benchmarks/prefix_bench.py end to end on CPU (a tiny random target, XLA matmuls): reuse off and on
rows per prefix length, every timed request of the reuse-on row found its whole shared prefix cached
(the primer's blocks and ring snapshot), the off row found nothing. CPU timings mean little; the
structure and the hits are checked."""
import json
import os
import sys

from support.paths import REPO  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import prefix_bench  # noqa: E402


def test_tiny_prefix_reuse_on_and_off(tmp_path):
    out = str(tmp_path / "o")
    prefix_bench.main(["--target", "tiny", "--layers", "2", "--prefix-len", "128", "--suffix-len", "8",
                       "--requests", "2", "--max-tokens", "3", "--prefill-chunk", "32", "--backend", "xla",
                       "--out", out])
    rows = json.load(open(os.path.join(out, "prefix.json")))["rows"]
    assert [(r["prefix_len"], r["reuse"]) for r in rows] == [(128, False), (128, True)]
    off, on = rows
    assert off["hit_tokens_per_request"] == 0 and on["hit_tokens_per_request"] == 128
    assert len(on["ttft_s"]) == 2 and all(t > 0 for t in on["ttft_s"] + off["ttft_s"])
    assert on["ratio"] == on["ttft_median_s"] / off["ttft_median_s"]
    assert "| 128 | on |" in open(os.path.join(out, "prefix.md")).read()
