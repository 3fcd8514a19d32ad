"""benchmarks/triton_ir.py: the Triton IR of our kernels is built on a machine without a GPU, and
the compile report tells the two GEMVs' loops apart (checked when the `triton` compiler is
installed; CI has no triton, so that part is skipped there)."""
import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import triton_ir  # noqa: E402
from pallas_kernels.kernel import Tiling  # noqa: E402


def test_lowers_the_kernel_for_cuda_without_a_gpu(tmp_path):
    ttir = triton_ir.lower_to_ttir(256, 512, 3, Tiling(block_n=64, split_k=2))
    assert "tt.func" in ttir and "tt.dot" in ttir and "scf.for" in ttir
    assert triton_ir.main(["--shape", "256,512", "--rows", "3", "--kernel", "mma", "--set", "groups_per_step=2",
                           "--out", str(tmp_path)]) == 0
    assert "tt.dot" in open(tmp_path / "kernel.ttir").read()
    # the CUDA-core GEMV: no dot, its code conversion as inline PTX (shift + lop3)
    assert triton_ir.main(["--shape", "256,512", "--rows", "3", "--kernel", "fma", "--out", str(tmp_path)]) == 0
    ttir = open(tmp_path / "kernel.ttir").read()
    assert "tt.dot" not in ttir and "lop3.b32" in ttir and "scf.for" in ttir


def test_lowers_a_fused_launch_for_cuda(tmp_path):
    """kernel.launch_many: one Triton function, one branch (scf.if) and one K loop per weight."""
    assert triton_ir.main(["--shape", "256,512", "--many", "128,64,64", "--rows", "1", "--kernel", "mma",
                           "--out", str(tmp_path)]) == 0
    ttir = open(tmp_path / "kernel.ttir").read()
    assert ttir.count("tt.func ") == 1 and ttir.count("scf.if") >= 3 and ttir.count("tt.dot") >= 3


def test_sass_loop_ops_reads_the_longest_backward_branch():
    sass = ("        /*0000*/  MOV R1, R2 ;\n        /*0010*/  FFMA R1, R2, R3, R1 ;\n"
            "        /*0020*/  @!P0 LOP3.LUT R4, R1, 0xf, RZ, 0xc0, !PT ;\n"
            "        /*0030*/  @P1 BRA `(.L_x_1) ;\n        /*0040*/  BRA 0x10 ;\n        /*0050*/  EXIT ;")
    assert triton_ir.sass_loop_ops(sass) == {"FFMA": 1, "LOP3": 1, "BRA": 2}


def test_main_loop_is_the_first_for_body():
    text = "a\nscf.for %i = ... {\n  x = tt.load p\n  scf.if c {\n y \n}\n scf.yield x\n}\n tail {}"
    body = triton_ir.main_loop(text)
    assert "tt.load" in body and "scf.yield x" in body and "tail" not in body


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton compiler not installed")
def test_report_tells_the_gemv_loops_apart(tmp_path):
    """The tensor-core GEMV pipelines its weight and activation tiles (async copies) and waits for its
    two scale/bias loads; the paired unpack spends fewer shared-memory operations and loop
    instructions per weight than the broadcast unpack (docs/kernels.md, log entry 7); the CUDA-core
    GEMV has no async copies."""
    from pallas_kernels.gemv import GemvTiling
    reports = {}
    for name, tiling in (("pairs", Tiling(block_n=128, split_k=2, groups_per_step=1, unpack="pairs")),
                         ("broadcast", Tiling(block_n=128, split_k=2, groups_per_step=1, unpack="broadcast")),
                         ("fma", GemvTiling(block_n=64, groups_per_step=4, split_k=8))):
        out = tmp_path / name
        out.mkdir()
        path = out / "kernel.ttir"
        path.write_text(triton_ir.lower_to_ttir(15360, 3840, 1, tiling))
        reports[name] = triton_ir.compile_and_report(str(path), tiling, str(out))
    for name in ("pairs", "broadcast"):
        assert reports[name]["loop_async_copies"] > 0 and reports[name]["loop_plain_loads_waited_for"] == 2
    assert reports["fma"]["loop_async_copies"] == 0

    def shared_ops(r):
        return r["loop_shared_ops"]["LDS"] + r["loop_shared_ops"]["STS"]
    assert 0 < shared_ops(reports["pairs"]) < shared_ops(reports["broadcast"]) / 4
    assert 0 < reports["pairs"]["loop_instructions_per_weight"] < reports["broadcast"]["loop_instructions_per_weight"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton compiler not installed")
def test_kpairs_keeps_the_mma_operand_out_of_shared_memory(tmp_path):
    """The default launch shape (64-row tiles): the kpairs unpack stores less to shared memory,
    waits at fewer barriers and issues fewer loop instructions than the pairs unpack."""
    reports = {}
    for unpack in ("pairs", "kpairs"):
        out = tmp_path / unpack
        out.mkdir()
        path = out / "kernel.ttir"
        tiling = Tiling(block_n=64, split_k=8, unpack=unpack)
        path.write_text(triton_ir.lower_to_ttir(15360, 3840, 1, tiling))
        reports[unpack] = triton_ir.compile_and_report(str(path), tiling, str(out))
    pairs, kpairs = (reports[u]["loop_shared_ops"] for u in ("pairs", "kpairs"))
    assert kpairs["STS"] < pairs["STS"] and kpairs["BAR"] < pairs["BAR"] and kpairs["LDSM"] < pairs["LDSM"]
    assert reports["kpairs"]["loop_instructions_per_weight"] < reports["pairs"]["loop_instructions_per_weight"]
