"""benchmarks/kernel_bench.py and kernel_report.py on the CPU (Pallas interpret mode, a small shape):
the explicit-tiling phases run their launches through pallas_kernels.launch with the tilings they
record, and the report renders them. Timings on CPU mean nothing; the plumbing is what is checked."""
import dataclasses
import json
import os
import sys

from support.paths import REPO  # noqa: E402
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import kernel_bench as kb  # noqa: E402
import kernel_report as kr  # noqa: E402
from support.fake_terminal import Terminal  # noqa: E402
from jaxspec.kernels.launch import gemv_tiling, qmm_tiling  # noqa: E402


def test_sweep_and_tiles_phases_and_report(tmp_path, monkeypatch, capsys):
    """(On a terminal's stderr, which gets each phase's progress bar; stdout only the results.)"""
    out = str(tmp_path / "kb")
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    kb.main(["--out", out, "--shapes", "256x512", "--phase", "sweep,tiles", "--variants", "default;bf16 dot",
             "--tile-rows", "16", "--commit", "abc1234"])
    monkeypatch.undo()
    assert "sweep shapes" in term.getvalue() and "tiles shapes" in term.getvalue()
    stdout = capsys.readouterr().out
    assert "\r" not in stdout and "shapes:" not in stdout and "phase tiles took" in stdout
    rows = kr.load([os.path.join(out, "kernels.jsonl")])
    [env] = [r for r in rows if r["phase"] == "env"]
    assert env["commit"] == "abc1234"
    assert not [r for r in rows if "error" in r]
    [sweep] = [r for r in rows if r["phase"] == "sweep"]
    assert sweep["rows"] == 1 and sweep["us"] > 0
    assert sweep["tiling"] == dataclasses.asdict(gemv_tiling((256, 512), 64))
    tiles = {r["variant"]: r for r in rows if r["phase"] == "tiles"}
    assert set(tiles) == {"default", "bf16 dot"} and all(r["us"] > 0 for r in tiles.values())
    assert tiles["default"]["tiling"] == dataclasses.asdict(qmm_tiling(16, (256, 512), 64, kb.DEFAULT))
    # a table row as the table phase writes it (that phase compiles every path: too slow here)
    table = dict(phase="table", n=256, k=512, rows=8, backend="pallas", path="multirow", us=20.0,
                 floor_us=5.0, tbps=0.004)
    with open(os.path.join(out, "kernels.jsonl"), "a") as f:
        f.write(json.dumps(table) + "\n")
    md = str(tmp_path / "k.md")
    kr.report(kr.load([os.path.join(out, "kernels.jsonl")]), md, None, "cmd")
    text = open(md).read()
    assert "commit abc1234" in text
    assert "| 256x512 | 8 | pallas | multirow | 20.0 | 0.00 | 25.0 |" in text
    assert "## qmm tilings around the default (us)" in text and "| 256x512 | 16 |" in text
    assert "## GEMV launches around the default" in text and "| 256x512 | 1 | default | 64 |" in text


def test_format_sets_the_weights_bits_group_and_scale_dtype():
    """--format 8/32/f32 (Gemma 3 270M's exact GGUF mapping): the benchmark's weights are 8-bit g32 with
    float32 scales and the bytes its floor counts are theirs (a sweep here would take minutes)."""
    fmt = kb.Format.parse("8/32/f32")
    assert (fmt.bits, fmt.group, fmt.scale_dtype, str(fmt)) == (8, 32, "float32", "8/32/f32")
    kb.FMT = fmt
    try:
        qw = kb.random_qweight(kb.jax.random.key(1), 256, 640)
        assert (qw.bits, qw.group_size, str(qw.scales.dtype), qw.shape) == (8, 32, "float32", (256, 640))
        assert kb.qbytes(256, 640) == 256 * 640 + 2 * 4 * 256 * 20
    finally:
        kb.FMT = kb.Format()
    assert kb.qbytes(256, 640) == 256 * 640 // 2 + 2 * 2 * 256 * 10
    for bad in ("8", "8/32/bf16", "x/32", "²/32"):
        try:
            kb.Format.parse(bad)
        except ValueError as e:
            assert "--format" in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")
