"""Small GGUF files for the tests of models.gguf and its fuzzing: random valid tensor blocks, a tiny
Gemma 3 GGUF written with gguf.GGUFWriter, the byte positions of its tensor table (located by
gguf.GGUFReader, an independent parser) and the raw patches that mutate it, and `bounded`, which
fails what runs past a time or memory bound."""
import contextlib
import re
import resource
import signal
import struct

import gguf
import numpy as np

from jaxspec.models import gguf as G

QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType
D_FIELDS = {G.Q8_0: (0,), G.Q5_0: (0,), G.Q4_K: (0, 2), G.Q6_K: (208,)}  # byte offsets of fp16 d / dmin


def random_blocks(rng, qtype: int, n: int, k: int, wide: bool = False) -> np.ndarray:
    """Random bytes `[n, row bytes]` of a GGUF tensor of type `qtype`, with finite fp16 d fields:
    `wide` draws them from every finite fp16 bit pattern (subnormals included), else ~N(0, 0.02)."""
    _, block, size = G.TYPES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in D_FIELDS[qtype]:
        if wide:
            bits = rng.integers(0, 1 << 16, (n, k // block), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # inf / NaN (exponent all ones) -> a finite value
            d = bits.view(np.float16)
        else:
            d = (rng.standard_normal((n, k // block)) * 0.02).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


# ---- a tiny Gemma 3 GGUF ------------------------------------------------------------------------------
TINY = dict(hidden=256, ff=512, heads=2, kv=1, head_dim=128, layers=6, vocab=300)
# the real file's pattern of types (Q5_0 q/k/gate/up, Q8_0 embedding and some v, Q4_K output and half the
# down projections, Q6_K the others)
TINY_TYPES = {"token_embd": G.Q8_0, "attn_q": G.Q5_0, "attn_k": G.Q5_0, "attn_output": G.Q4_K,
              "ffn_gate": G.Q5_0, "ffn_up": G.Q5_0}


def tiny_tensors(c=TINY):
    """GGUF name -> (shape [rows, cols], type) of a tiny gemma3 file."""
    h, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv"] * c["head_dim"]
    out = {"token_embd.weight": ((c["vocab"], h), G.Q8_0), "output_norm.weight": ((h,), G.F32)}
    for i in range(c["layers"]):
        for name, shape, t in (("attn_q", (q, h), G.Q5_0), ("attn_k", (kv, h), G.Q5_0),
                               ("attn_v", (kv, h), G.Q8_0 if i % 2 else G.Q5_0), ("attn_output", (h, q), G.Q4_K),
                               ("ffn_gate", (c["ff"], h), G.Q5_0), ("ffn_up", (c["ff"], h), G.Q5_0),
                               ("ffn_down", (h, c["ff"]), G.Q4_K if i % 2 else G.Q6_K)):
            out[f"blk.{i}.{name}.weight"] = (shape, t)
        for name, n in (("attn_norm", h), ("attn_q_norm", c["head_dim"]), ("attn_k_norm", c["head_dim"]),
                        ("post_attention_norm", h), ("ffn_norm", h), ("post_ffw_norm", h)):
            out[f"blk.{i}.{name}.weight"] = ((n,), G.F32)
    return out


def write_tiny(path, rng, *, arch="gemma3", tensors=None, c=TINY, meta=None) -> str:
    """A tiny GGUF of architecture `arch` with random valid tensors (`tensors`: name -> (shape, type)
    overriding tiny_tensors; a type outside G.TYPES gets random bytes of its block size); `meta`:
    key -> (gguf.GGUFValueType, value) added to the metadata or replacing a value in place."""
    w = gguf.GGUFWriter(str(path), arch)
    a = arch + "."
    for key, v in (("block_count", c["layers"]), ("embedding_length", c["hidden"]),
                   ("feed_forward_length", c["ff"]), ("context_length", 4096), ("attention.head_count", c["heads"]),
                   ("attention.head_count_kv", c["kv"]), ("attention.key_length", c["head_dim"]),
                   ("attention.value_length", c["head_dim"]), ("attention.sliding_window", 64)):
        w.add_uint32(a + key, v)
    w.add_float32(a + "rope.freq_base", 1e6)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(c["vocab"] - 4)])
    w.add_array("tokenizer.ggml.scores", [float(-i) for i in range(c["vocab"])])
    w.add_array("tokenizer.ggml.token_type", [3, 3, 3, 2] + [1] * (c["vocab"] - 4))
    for key, v in (("bos_token_id", 2), ("eos_token_id", 1), ("unknown_token_id", 3), ("padding_token_id", 0)):
        w.add_uint32("tokenizer.ggml." + key, v)
    for key, (vtype, v) in (meta or {}).items():
        w.add_key_value(key, v, vtype)
    spec = dict(tiny_tensors(c), **(tensors or {}))
    for name, (shape, t) in spec.items():
        if t == G.F32:
            data = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)  # Gemma's stored 1 + w
            w.add_tensor(name, data)
            continue
        if t in G.TYPES:
            raw = random_blocks(rng, t, int(np.prod(shape[:-1])), shape[-1])
        else:
            block, size = gguf.GGML_QUANT_SIZES[QT(t)]
            raw = rng.integers(0, 256, (int(np.prod(shape[:-1])), shape[-1] // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=QT(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ---- its tensor table, and raw patches -----------------------------------------------------------------
ALIGN = 32  # the gguf package's default alignment, which write_tiny's files have


def table_positions(path) -> dict[str, dict[str, int]]:
    """Tensor name -> the byte positions of its tensor-table fields ("name_len", "n_dims", "dims",
    "type", "offset"), in table order, located by gguf.GGUFReader (an independent parser)."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        pos, at = t.field.offset, {}
        for part, role in zip(t.field.parts, ("name_len", "name", "n_dims", "dims", "type", "offset")):
            at[role], pos = pos, pos + int(part.nbytes)
        out[t.name] = at
    return out


def patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    return data[:pos] + struct.pack(fmt, value) + data[pos + struct.calcsize(fmt):]


def insert_entry(data: bytes, key: bytes, vtype: int, payload: bytes, pad: bool = True) -> bytes:
    """`data` with one more metadata entry (raw bytes, placed first). `pad`: its key padded with '_'
    (unless it would change) to a multiple of the alignment in all, so that the data section moves by
    that much and the tensors' offsets, relative to it, stay right."""
    def entry(k: bytes) -> bytes:
        return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload

    if pad and len(entry(key)) % ALIGN:
        key += b"_" * (-len(entry(key)) % ALIGN)
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    return patch(data, 16, "<Q", n_kv + 1)[:24] + entry(key) + data[24:]


@contextlib.contextmanager
def bounded(seconds: float, memory: int):
    """Fail (TimeoutError, MemoryError) what runs inside past `seconds` of wall time, or past `memory`
    bytes more of this process's data segment (RLIMIT_DATA: the heap and private maps; JAX's running
    threads share it, so the margin is generous)."""
    def vm_data() -> int:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmData:\s+(\d+) kB", f.read()).group(1)) * 1024

    def expire(*_):
        raise TimeoutError(f"ran past {seconds} s")

    limits = resource.getrlimit(resource.RLIMIT_DATA)
    cap = vm_data() + memory
    resource.setrlimit(resource.RLIMIT_DATA, (cap if limits[1] == resource.RLIM_INFINITY else min(cap, limits[1]),
                                              limits[1]))
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        resource.setrlimit(resource.RLIMIT_DATA, limits)
