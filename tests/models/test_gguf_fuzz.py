"""models.gguf fuzzed: a small Gemma 3 GGUF written with gguf.GGUFWriter, mutated a few hundred
ways (the run's seed), each read in-process (read_gguf, then the tokenizer) within a time and a
memory bound. Every mutation must end in one of two ways:

* refused: one ValueError line naming the file (the tokenizer's TokenizerError is one);
* accepted: then gguf.GGUFReader, an independent parser, reads the file the same way: the same
  metadata and the same tensor table (names, types, shapes, data offsets, byte sizes).

The mutations are of the header and the layout, at the byte positions of their fields (located by
GGUFReader on the unmutated file): a count, length, type id, dimension, offset or value set to an
edge value; random bytes of the header overwritten; the file cut short; a tensor's offset set to
another's, its type to another id, its dimensions swapped or changed; an entry inserted (a
duplicate key, arrays nested up to 6,000 deep, a key or a string of 100 kB, general.alignment of
any type). Ten of the refused files also go through `jaxspec convert`: exit 2, one line, nothing
written.
"""
import struct
import time

import gguf
import numpy as np
import pytest

from jaxspec.models import gguf as G
from jaxspec.text.gguf import tokenizer_from_gguf
from support.cli_errors import one_line_error
from support.gguf_files import ALIGN, VT, bounded, insert_entry, patch, write_tiny
from support.seeds import seeded_rng

CASES = 300
SMALL = dict(hidden=256, ff=256, heads=1, kv=1, head_dim=256, layers=1, vocab=40)  # a 330 kB file
PER_CASE_S, PER_CASE_MEMORY, TOTAL_S = 5.0, 512 << 20, 60.0
CLI_CASES = 10
FMT = {"<u4": "<I", "<u8": "<Q", "<i4": "<i", "<i8": "<q", "<f4": "<f", "<f8": "<d"}
SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}


def locate(path):
    """(numbers, tensors) of a GGUF, from gguf.GGUFReader's parts: `numbers`, per field (the
    header's three, each metadata entry, each tensor-table entry), its numbers as (byte position,
    struct format, what); `tensors`, per tensor-table entry, {"name", "dims": [(pos, fmt)], "type":
    (pos, fmt), "offset": (pos, fmt)}."""
    def parts(field):  # per part: its numbers' (position, format)
        pos, out = field.offset, []
        for part in field.parts:
            fmt = FMT.get(part.dtype.str)
            out.append([(pos + j * part.itemsize, fmt) for j in range(part.size)] if fmt else [])
            pos += int(part.nbytes)
        return out

    r = gguf.GGUFReader(path)
    numbers, tensors = [], []
    for field, is_tensor in [(f, False) for f in r.fields.values()] + [(t.field, True) for t in r.tensors]:
        found = parts(field)
        numbers.append([(p, fmt, f"{field.name!r} part {i}") for i, ps in enumerate(found) for p, fmt in ps])
        if is_tensor:  # name length, name, n_dims, dims, type, offset
            tensors.append({"name": field.name, "dims": found[3], "type": found[4][0], "offset": found[5][0]})
    return numbers, tensors


def edge_values(fmt: str, v, size: int, rng) -> list:
    if fmt in ("<f", "<d"):
        return [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 3.0e38, v * 2]
    bits = struct.calcsize(fmt) * 8
    lo, hi = (-(1 << bits - 1), (1 << bits - 1) - 1) if fmt in ("<i", "<q") else (0, (1 << bits) - 1)
    vals = [0, 1, v - 1, v + 1, 2 * v, v + ALIGN, v - ALIGN, size, 1 << 31, hi, lo, int(rng.integers(0, 1 << 63)) % hi]
    return [x for x in vals if lo <= x <= hi]


def pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def mutations(data: bytes, numbers, tensors, data_start: int, rng):
    """(kind, what, bytes) of CASES seeded mutations of the GGUF bytes `data`."""
    kinds = ("number", "number", "number", "bytes", "cut", "tensor", "entry")
    for _ in range(CASES):
        kind = pick(rng, kinds)
        if kind == "number":
            pos, fmt, what = pick(rng, pick(rng, numbers))
            v = struct.unpack_from(fmt, data, pos)[0]
            new = pick(rng, edge_values(fmt, v, len(data), rng))
            yield kind, f"{what} = {new!r} (was {v!r})", patch(data, pos, fmt, new)
        elif kind == "bytes":
            out = np.frombuffer(data, np.uint8).copy()
            at = rng.integers(0, data_start, int(rng.integers(1, 5)))
            out[at] = rng.integers(0, 256, len(at), dtype=np.uint8)
            yield kind, f"header bytes {sorted(at.tolist())} overwritten", out.tobytes()
        elif kind == "cut":
            end = int(rng.integers(0, data_start) if rng.random() < 0.7 else rng.integers(data_start, len(data)))
            yield kind, f"cut to {end} bytes", data[:end]
        elif kind == "tensor":
            yield (kind, *tensor_mutation(data, tensors, rng))
        else:
            yield (kind, *entry_mutation(data, rng))


def tensor_mutation(data: bytes, tensors, rng):
    """A tensor-table entry's offset set to another's, its type to another GGML type id, or its
    dimensions swapped, doubled or zeroed."""
    t, r = pick(rng, tensors), rng.random()
    if r < 0.35:
        new = struct.unpack_from("<Q", data, pick(rng, tensors)["offset"][0])[0]
        return f"tensor {t['name']!r} offset = {new}", patch(data, *t["offset"], new)
    if r < 0.7:
        new = int(rng.integers(0, 42))
        return f"tensor {t['name']!r} type = {new}", patch(data, *t["type"], new)
    ne = [struct.unpack_from(fmt, data, p)[0] for p, fmt in t["dims"]]
    new = ne[::-1] if len(ne) > 1 and r < 0.85 else [ne[0] * int(pick(rng, [0, 2]))] + ne[1:]
    for (p, fmt), d in zip(t["dims"], new):
        data = patch(data, p, fmt, d)
    return f"tensor {t['name']!r} dims = {new} (were {ne})", data


def entry_mutation(data: bytes, rng):
    """An entry inserted first: a duplicate key, nested arrays, a key or a string of 100 kB, or
    general.alignment of a random type and value (these two not padded: the data section may move)."""
    r = rng.random()
    if r < 0.25:
        key = pick(rng, [b"general.architecture", b"tokenizer.ggml.model", b"gemma3.block_count"])
        return f"duplicate key {key!r}", insert_entry(data, key, VT.UINT32, b"\1\0\0\0", pad=False)
    if r < 0.5:
        depth = int(pick(rng, [2, 3, 4, 5, 6, 50, 6000]))
        body = struct.pack("<IQ", VT.ARRAY, 1) * (depth - 1) + struct.pack("<IQ", VT.UINT8, 0)
        return f"arrays nested {depth} deep", insert_entry(data, b"x.nested", VT.ARRAY, body)
    if r < 0.65:
        if rng.random() < 0.5:
            return "a key of 100 kB", insert_entry(data, b"k" * 100_000, VT.UINT8, b"\1")
        return "a string of 100 kB", insert_entry(data, b"x.long", VT.STRING, struct.pack("<Q", 100_000) + b"s" * 100_000)
    vtype, v = int(rng.integers(0, 13)), int(pick(rng, [0, 1, 3, 16, 32, 64, 1 << 31]))
    if vtype == VT.STRING:
        payload = struct.pack("<Q", len(str(v))) + str(v).encode()
    elif vtype == VT.ARRAY:
        payload = struct.pack("<IQI", VT.UINT32, 1, v)
    elif SCALAR[vtype] in ("<f", "<d"):
        payload = struct.pack(SCALAR[vtype], float(v))
    else:
        fmt = SCALAR[vtype]
        hi = 1 if vtype == VT.BOOL else (1 << struct.calcsize(fmt) * 8 - (fmt in ("<b", "<h", "<i", "<q"))) - 1
        payload = struct.pack(fmt, min(v, hi))
    return (f"general.alignment of type {vtype} = {payload.hex()}",
            insert_entry(data, b"general.alignment", vtype, payload, pad=False))


def read(path: str, what: str):
    """The reader on `path` (read_gguf, then the tokenizer when it accepts): the GGUFCheckpoint, or
    None when refused; anything but a one-line refusal naming the file fails the test."""
    try:
        with bounded(PER_CASE_S, PER_CASE_MEMORY):
            try:
                ck = G.read_gguf(path)
            except ValueError as e:
                return refused(e, path, what)
            try:
                tokenizer_from_gguf(path)
            except ValueError as e:  # TokenizerError
                refused(e, path, what)
            return ck
    except Exception as e:  # TimeoutError, MemoryError, RecursionError, a bug
        pytest.fail(f"{what}: {type(e).__name__}: {e}")


def refused(e: ValueError, path: str, what: str) -> None:
    msg = str(e)
    assert "\n" not in msg and path in msg and len(msg) < 1000, (what, msg)
    return None


def same_as_reference(path: str, ck, what: str) -> None:
    """An accepted file read as gguf.GGUFReader reads it: metadata (but arrays of arrays, which
    GGUFReader flattens) and tensor table."""
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:
        pytest.fail(f"{what}: accepted, but gguf.GGUFReader refuses it: {type(e).__name__}: {e}")
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(ck.metadata) == list(fields), what
    for key, f in fields.items():
        if f.types.count(VT.ARRAY) < 2:
            assert repr(ck.metadata[key]) == repr(f.contents()), (what, key)
    ours = [(t.name, t.type, t.shape, t.offset, t.nbytes) for t in G.plan(path)[2]]
    ref = [(t.name, int(t.tensor_type), tuple(reversed(t.shape.tolist())), t.data_offset, t.n_bytes) for t in r.tensors]
    assert ours == ref, what


def test_mutated_files_refused_in_one_line_or_read_as_gguf_reads_them(tmp_path, capsys):
    rng = seeded_rng()
    base = write_tiny(tmp_path / "base.gguf", rng, c=SMALL)
    data = open(base, "rb").read()
    numbers, tensors = locate(base)
    data_start = G.plan(base)[2][0].offset
    same_as_reference(base, read(base, "unmutated"), "unmutated")
    path, outcomes, for_cli = str(tmp_path / "mutated.gguf"), {}, {}
    t0 = time.perf_counter()
    for kind, what, content in mutations(data, numbers, tensors, data_start, rng):
        with open(path, "wb") as f:
            f.write(content)
        ck = read(path, what)
        if ck is not None:
            same_as_reference(path, ck, what)
        elif len(for_cli.setdefault(kind, [])) < 2:
            for_cli[kind].append(content)
        outcomes[ck is None] = outcomes.get(ck is None, 0) + 1
    elapsed = time.perf_counter() - t0
    assert elapsed < TOTAL_S, f"{CASES} cases took {elapsed:.1f} s"
    assert outcomes.get(True, 0) > CASES // 2, outcomes  # the mutations reach the checks
    out = tmp_path / "out"
    chosen = [c for cs in for_cli.values() for c in cs][:CLI_CASES]
    for i, content in enumerate(chosen):
        with open(path, "wb") as f:
            f.write(content)
        one_line_error(capsys, "convert", path, str(out))
        assert not out.exists(), i
    assert len(chosen) == CLI_CASES
