"""benchmarks/attention_bench.py's paged mode on the CPU (--tiny: toy shapes, the kernels in interpret
mode): paged_attention, the gather path and the XLA reference each agree with the reference on
both length scenarios at T = 1 and 4, and the report holds their table. Timings on CPU mean nothing."""
import json
import os
import sys

from support.paths import REPO
from support.seeds import seeded_int

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import attention_bench as ab  # noqa: E402


def test_paged_tiny_mode(tmp_path, capsys):
    ab.main(["--ops", "paged", "--tiny", "--seed", str(seeded_int(1 << 20)), "--out", str(tmp_path)])
    rows = json.load(open(tmp_path / "attention.json"))["rows"]
    variants = ["xla gather + dense", "gather + decode_attention", "paged_attention"]
    assert [(r["kind"], r["t"], r["variant"]) for r in rows] == [
        (f"global, 2 slots {s}", t, v) for s in ("nearly full", "ragged") for t in (1, 4) for v in variants]
    assert all(r["ok"] is True and r["us"] > 0 and r["context"] == 64 for r in rows)
    table = open(tmp_path / "attention.md").read()
    assert table.count("| paged | global, 2 slots") == len(rows)
    assert table.split("| op |", 1)[1] in capsys.readouterr().out  # printed as well
