"""benchmarks/context_bench.py end to end on the CPU (tiny preset): one row per context length with
its timings and memory fields, the speculative columns where asked (greedy equal to classic, the
exactness probe passing), and the report files. CPU timings mean nothing; structure and parity do."""
import json
import os
import sys

from support.paths import REPO  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import context_bench  # noqa: E402


def test_tiny_sweep_writes_rows_and_speculative_parity(tmp_path):
    out = str(tmp_path / "o")
    rows = context_bench.main(["--target", "tiny", "--assistant", "tiny", "--context", "200,40",
                               "--spec-context", "200", "--max-tokens", "12", "--repeats", "1", "--out", out])
    assert [r["context"] for r in rows] == [40, 200]  # increasing order
    for r in rows:
        assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0 and r["peak_gib"] >= 0
        assert abs(r["prefill_tok_s"] - r["context"] / r["prefill_s"]) < 1e-6 * r["prefill_tok_s"]
    assert "spec_round_fwd" not in rows[0]
    spec = rows[1]
    assert spec["spec_greedy_equal"] and spec["spec_fallback"] is None and spec["spec_block"] == 4
    assert spec["spec_rounds"] > 0 and spec["spec_round_fwd"] > 0
    saved = json.load(open(os.path.join(out, "context.json")))
    assert saved["rows"] == json.loads(json.dumps(rows))
    md = open(os.path.join(out, "context.md")).read()
    assert "| 200 |" in md and "| 40 |" in md and "matmul xla" in md  # auto on a CPU: not the kernels' interpreter
