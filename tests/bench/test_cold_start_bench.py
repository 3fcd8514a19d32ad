"""benchmarks/cold_start_bench.py on the CPU (tiny preset, XLA matmuls): a fresh process per row,
the first call compiling the named programs and the second compiling none of them, the report files;
with --disk-cache warm the second process loads the programs the first kept on disk."""
import json
import os
import sys

from support.paths import REPO  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import cold_start_bench  # noqa: E402


def test_tiny_rows_name_programs_and_the_warm_cache_serves(tmp_path):
    out = str(tmp_path / "o")
    rows = cold_start_bench.main(["--target", "tiny", "--layers", "2", "--block-size", "1", "--prompt-len", "12",
                                  "--max-tokens", "4", "--backend", "xla", "--disk-cache", "warm", "--out", out])
    assert [r["disk_cache"] for r in rows] == ["cold", "warm"]
    for r in rows:
        first = [p["name"] for p in r["first"]["programs"]]
        assert first.count("prefill") == 1 and first.count("decode") == 1, first
        assert not {"prefill", "decode"} & {p["name"] for p in r["second"]["programs"]}
        assert r["first"]["tokens"] == r["second"]["tokens"] == 4 and r["load_s"] > 0
    assert rows[0]["first"]["ids"] == rows[1]["first"]["ids"]  # same prompt, loaded programs: same tokens
    cold, warm = ([p for p in r["first"]["programs"] if p["name"] in ("prefill", "decode")] for r in rows)
    assert all(p["compile_s"] > 0 and not p["load_s"] for p in cold)
    assert all(p["load_s"] > 0 and not p["compile_s"] for p in warm)  # loaded whole: no trace, no compile
    saved = json.load(open(os.path.join(out, "cold_start.json")))
    assert len(saved["rows"]) == 2 and "| 2 | 1 | warm |" in open(os.path.join(out, "cold_start.md")).read()
