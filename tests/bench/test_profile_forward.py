"""benchmarks/profile_forward.py: the trace parsing on a synthetic GPU trace (exact sums), and the
whole tool end to end on the CPU (host events: only the plumbing is meaningful there)."""
from support.paths import REPO  # noqa: E402
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import profile_forward as pf  # noqa: E402
from support.seeds import seeded_int  # noqa: E402


def _meta(pid, name, tid=None, thread=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}


def _x(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_sums_only_the_device_stream_kernels():
    trace = {"traceEvents": [
        _meta(1, "/host:CPU"), _meta(1, None, 7, "python"),
        _meta(2, "/device:GPU:0"), _meta(2, None, 1, "Stream #13(Compute)"), _meta(2, None, 2, "XLA Ops"),
        _x(1, 7, "PjitFunction(run)", 0, 500.0),                      # host: not device work
        _x(2, 2, "fusion.3", 10, 40.0),                               # the op level repeats the kernels
        _x(2, 1, "q4gemv_m16_n64", 10, 12.5), _x(2, 1, "q4gemv_m16_n64_x3", 30, 7.5),
        _x(2, 1, "q4qmm_m64_n128", 40, 6.0), _x(2, 1, "q4qmm_m16_n128", 50, 3.0),
        _x(2, 1, "loop_multiply_fusion", 60, 2.0), _x(2, 1, "nvjet_hsh_64x8_gemm", 70, 4.0),
        _x(2, 1, "some_custom_thing", 80, 1.0)]}
    events, source = pf.kernel_events(trace)
    assert source == "device streams" and len(events) == 7
    s = pf.summarize(events, forwards=2)
    kinds = {k: v["us"] for k, v in s["by_kind"].items()}
    # (a qmm launch with 16-row tiles is still the tiled GEMM, not the GEMV)
    assert kinds == {"4-bit GEMV": 10.0, "4-bit tiled matmul": 4.5, "dense matmul (XLA/cuBLAS)": 2.0,
                     "XLA fusion": 1.0, "other": 0.5}
    assert s["by_name"]["q4gemv_m16_n64"] == {"us": 6.25, "count": 0.5}
    assert s["busy_us"] == 18.0
    assert list(s["by_kind"])[0] == "4-bit GEMV"  # largest first


def test_kernel_names_of_older_traces():
    """Traces saved before the kernels' rename (--from-trace) still sort into the same kinds."""
    assert pf.kind_of("q4mm_m16_n64_x3") == "4-bit GEMV"
    assert pf.kind_of("q4mmdq_m64_n128") == pf.kind_of("q4mm_m64_n128") == "4-bit tiled matmul"


def test_leaves_drops_containers():
    evs = [_x(1, 1, "while", 0, 100.0), _x(1, 1, "op_a", 10, 20.0), _x(1, 1, "op_b", 40, 30.0),
           _x(1, 2, "other_thread", 5, 50.0)]
    assert sorted(e["name"] for e in pf.leaves(evs)) == ["op_a", "op_b", "other_thread"]


def test_end_to_end_on_cpu(tmp_path):
    assert pf.main(["--target", "tiny", "--steps", "1", "--out", str(tmp_path)]) == 0
    data = json.load(open(tmp_path / "profile.json"))
    assert data["wall_us"] > 0 and data["busy_us"] > 0
    assert "XLA fusion" in data["by_kind"]
    assert math.isclose(sum(v["us"] for v in data["by_kind"].values()), data["busy_us"], rel_tol=1e-9)
    text = open(tmp_path / "profile.md").read()
    assert "| kind |" in text and "preset tiny" in text


def test_overlapping_stream_kernels_are_all_kept():
    """Consecutive GPU kernels whose trace timestamps overlap slightly (seen on the H200) are not nested."""
    evs = [_x(2, 1, "q4gemv_m16_n64", 0, 50.0), _x(2, 1, "fusion_1", 49.9, 2.0), _x(2, 1, "q4gemv_m16_n64", 51.8, 50.0)]
    assert [e["name"] for e in pf.leaves(evs)] == ["q4gemv_m16_n64", "fusion_1", "q4gemv_m16_n64"]


def test_from_trace_rebuilds_the_same_summary(tmp_path):
    assert pf.main(["--target", "tiny", "--steps", "1", "--out", str(tmp_path)]) == 0
    first = json.load(open(tmp_path / "profile.json"))
    stale = dict(first, by_name={}, by_kind={}, busy_us=0.0)  # as if an older parser had summed nothing
    json.dump(stale, open(tmp_path / "profile.json", "w"))
    os.remove(tmp_path / "profile.md")
    assert pf.main(["--from-trace", "--out", str(tmp_path)]) == 0
    again = json.load(open(tmp_path / "profile.json"))
    assert again["by_name"] == first["by_name"] and again["busy_us"] == first["busy_us"] > 0
    assert "re-summarized" in open(tmp_path / "profile.md").read()


def test_draft_mode_profiles_the_assistant(tmp_path):
    """--draft: the assistant's chained draft steps, named as such, with the assistant's weight bytes."""
    assert pf.main(["--target", "tiny", "--draft", "--steps", "2", "--out", str(tmp_path)]) == 0
    data = json.load(open(tmp_path / "profile.json"))
    assert data["meta"]["what"].startswith("assistant draft steps of preset tiny")
    assert data["wall_us"] > 0 and data["busy_us"] > 0
    target, assistant, _ = pf.load_pair(type("A", (), dict(target="tiny", assistant="tiny", layers=0, seed=0,
                                                           float=False))(), pf.jnp.bfloat16, pf.DispatchConfig())
    assert math.isclose(data["meta"]["weight_gb"], pf.weight_bytes_per_token(assistant) / 1e9)
    assert pf.weight_bytes_per_token(assistant) != pf.weight_bytes_per_token(target)
    with pytest.raises(SystemExit):
        pf.main(["--target", "tiny", "--draft", "--width", "4", "--out", str(tmp_path)])


def test_context_fills_the_cache():
    """--context N: the profiled forwards start at N cached positions of a cache that holds them."""
    target, _, _ = pf.load_pair(type("A", (), dict(target="tiny", assistant=None, layers=0, seed=0, float=False))(),
                                pf.jnp.bfloat16, pf.DispatchConfig())
    n = seeded_int(300, 1000)
    _, (_, tokens, cache) = pf.forward_loop(target, 2, 1, 1, steps=1, context=n)
    assert cache.lengths.tolist() == [n, n] and n + 192 <= cache.capacity < n + 192 + 256
    with pytest.raises(SystemExit):
        pf.main(["--target", "tiny", "--context", "0"])
