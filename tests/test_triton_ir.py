"""benchmarks/triton_ir.py: the Triton IR of our kernel is built on a machine without a GPU, and
the prefetch option changes which scale/bias loads the K loop waits for (checked in the IR when the
`triton` compiler is installed; CI has no triton, so that part is skipped there)."""
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
    assert triton_ir.main(["--shape", "256,512", "--rows", "3", "--kernel", "mma", "--set", "prefetch_sb=True",
                           "--out", str(tmp_path)]) == 0
    assert "tt.dot" in open(tmp_path / "kernel.ttir").read()
    # the CUDA-core GEMV: no dot, its code conversion as inline PTX (shift + lop3)
    assert triton_ir.main(["--shape", "256,512", "--rows", "3", "--kernel", "fma", "--out", str(tmp_path)]) == 0
    ttir = open(tmp_path / "kernel.ttir").read()
    assert "tt.dot" not in ttir and "lop3.b32" in ttir and "scf.for" in ttir


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
def test_prefetch_moves_scale_loads_out_of_the_wait(tmp_path):
    reports = {}
    for pf in (False, True):
        out = tmp_path / str(pf)
        out.mkdir()
        path = out / "kernel.ttir"
        tiling = Tiling(block_n=128, split_k=2, groups_per_step=1, prefetch_sb=pf)
        path.write_text(triton_ir.lower_to_ttir(15360, 3840, 1, tiling))
        reports[pf] = triton_ir.compile_and_report(str(path), tiling, str(out))
    assert reports[False]["loop_plain_loads_waited_for"] == 2 and reports[False]["loop_plain_loads_prefetched"] == 0
    assert reports[True]["loop_plain_loads_waited_for"] == 0 and reports[True]["loop_plain_loads_prefetched"] == 2
    assert reports[True]["loop_async_copies"] == reports[False]["loop_async_copies"] > 0
