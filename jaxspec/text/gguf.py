"""The tokenizer stored in a GGUF file's metadata, rebuilt as a `tokenizers.Tokenizer`.

A GGUF (llama.cpp's format) carries no `tokenizer.json`: its vocabulary is metadata under
`tokenizer.ggml.*` (the pieces, their scores and types, the special token ids, the add-BOS/EOS
flags, sometimes a chat template). Gemma's is a SentencePiece BPE vocabulary
(`tokenizer.ggml.model = llama`) with scores and no merges; this module rebuilds it so that its ids
equal transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)` on the same file:

    tok = jaxspec.text.tokenizer.load_tokenizer("gemma-3-270m-q4_k_m.gguf")   # or a directory holding one
    tok.save("converted/")                                               # tokenizer.json + tokenizer_config.json

How the SentencePiece vocabulary becomes a BPE model:

* Text is not pre-split and gets no prefix space (Gemma's `add_space_prefix` is false): every
  space becomes U+2581 ("\u2581"), the character the pieces spell spaces with. The file spells its
  pieces made only of spaces ("  ", "   ", ...) with real spaces; they are respelled with U+2581,
  or they could never match.
* SentencePiece BPE merges, at each step, the adjacent pair whose joined piece scores best. The
  file lists no merges, so they are rebuilt from the vocabulary: every way to cut a piece into two
  pieces that are both in the vocabulary is a merge, ranked by the joined piece's place in the file
  (earlier first, as transformers ranks Gemma's), and, for one piece, the longer left part first.
  For Gemma 3's ordinary pieces the place and the score give the same order (score = 463 or 494
  minus the id), but the space runs score -1000, like every user-defined piece: SentencePiece and
  llama.cpp match those whole, which ranking them by place reproduces ("    Several" is "▁▁▁▁"
  "Several"; by score it would be "▁▁▁" "▁Several").
* Characters no piece covers become their UTF-8 bytes, the `<0xNN>` pieces (byte fallback);
  decoding turns those back into bytes and U+2581 back into spaces.
* Control pieces (`<bos>`, `<start_of_turn>`, `<unusedN>`) are special added tokens and
  user-defined pieces (`\\n\\n`, `</iframe>`, ...) plain added tokens: either is matched whole
  wherever it appears in the text, before the BPE model sees the rest. Decoding with
  `skip_special_tokens` drops the control pieces.
* BOS is prepended when `tokenizer.ggml.add_bos_token` says so (or says nothing), EOS appended
  when `add_eos_token` does.

The metadata is read by the weights' own GGUF parser (`models.gguf.read_metadata`, about a second;
`gguf.GGUFReader` parses every array element, ~20 s for Gemma's 262,144 pieces). `reader=` takes
anything shaped like a GGUFReader (`.fields[key].contents()`), e.g. `models.gguf.MetadataReader`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from jaxspec.text.tokenizer import Tokenizer, TokenizerError

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Architectures whose SentencePiece vocabulary this module rebuilds: Gemma's conventions (no
# prefix space, merges ranked by place in the file) are not another family's. transformers builds
# Gemma 1 and 2 files the same way, but jaxspec runs neither and no such file was checked here.
SUPPORTED_ARCHITECTURES = ("gemma3",)
SUPPORTED_MODELS = ("llama",)  # tokenizer.ggml.model: SentencePiece; "gpt2" (byte-level BPE) etc. are not handled
SPACE = "\u2581"
# The longest piece rebuilt (characters): every cut of every piece is a candidate merge, so the
# rebuild takes the sum of the pieces' squared lengths; Gemma 3's longest is 31 (a run of tabs).
MAX_PIECE = 256


@dataclass
class GGUFVocab:
    """What a GGUF says about its tokenizer (the `tokenizer.ggml.*` keys jaxspec uses)."""
    path: str
    architecture: str
    model: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] = field(repr=False)
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    extra_eos_ids: tuple[int, ...] = ()  # end-of-turn / end-of-message tokens (eot_token_id, eom_token_id)
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool = False
    chat_template: str | None = None


def _open_reader(path: str):
    from jaxspec.models import gguf as gguf_file
    try:
        return gguf_file.MetadataReader(gguf_file.read_metadata(path))
    except ValueError as e:  # the parser names the file and what is missing, cut or corrupt
        raise TokenizerError(str(e)) from None


def read_vocab(path: str, reader=None) -> GGUFVocab:
    """The tokenizer metadata of the GGUF at `path` (read with `reader`, a `gguf.GGUFReader` open on
    it, when given). TokenizerError, one line, for a file that is not a GGUF, has no tokenizer, or
    has one this module does not rebuild."""
    r = reader if reader is not None else _open_reader(path)
    fields = r.fields

    def value(key, default=None):
        f = fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as e:
            raise TokenizerError(f"{path!r}: cannot read GGUF key {key} ({e})") from None

    model = value("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(f"{path!r} has no tokenizer in its metadata (no tokenizer.ggml.model): "
                             "pass --tokenizer with a tokenizer.json")
    arch = value("general.architecture")
    if model not in SUPPORTED_MODELS:
        raise TokenizerError(f"{path!r}: unsupported tokenizer.ggml.model {model!r} (jaxspec rebuilds "
                             f"{', '.join(map(repr, SUPPORTED_MODELS))} vocabularies of "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} models): pass --tokenizer with a tokenizer.json")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise TokenizerError(f"{path!r}: a {model!r} tokenizer of architecture {arch!r} is not supported (only "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}): pass --tokenizer with a tokenizer.json")
    tokens = value("tokenizer.ggml.tokens")
    scores = value("tokenizer.ggml.scores")
    types = value("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is str for t in tokens):
        raise TokenizerError(f"{path!r}: tokenizer.ggml.tokens is missing or not a list of strings")
    n = len(tokens)
    longest = max(range(n), key=lambda i: len(tokens[i]))
    if len(tokens[longest]) > MAX_PIECE:
        raise TokenizerError(f"{path!r}: token {longest} is {len(tokens[longest]):,} characters long; jaxspec "
                             f"rebuilds vocabularies of pieces up to {MAX_PIECE}")
    for key, arr in (("scores", scores), ("token_type", types)):
        if not isinstance(arr, list) or len(arr) != n:
            raise TokenizerError(f"{path!r}: tokenizer.ggml.{key} is missing or does not have one entry "
                                 f"per token ({n:,})")
    for key, arr, kind, ok in (("scores", scores, float, lambda v: True),
                               ("token_type", types, int, lambda v: 0 <= v <= BYTE)):
        bad = next((i for i, v in enumerate(arr) if type(v) is not kind or not ok(v)), None)
        if bad is not None:
            want = "a number (FLOAT32)" if kind is float else f"a token type (an integer 0..{BYTE})"
            raise TokenizerError(f"{path!r}: tokenizer.ggml.{key}[{bad}] = {_short(arr[bad])} is not {want}")

    def token_id(key):
        v = value(f"tokenizer.ggml.{key}")
        if v is None:
            return None
        if type(v) is not int or not 0 <= v < n:
            raise TokenizerError(f"{path!r}: tokenizer.ggml.{key} = {_short(v)} is not a token id (0..{n - 1})")
        return v

    def flag(key, default):
        v = value(f"tokenizer.ggml.{key}", default)
        if type(v) is not bool:  # no coercion: the string "false" is not False
            raise TokenizerError(f"{path!r}: tokenizer.ggml.{key} = {_short(v)} is not a bool")
        return v

    extra = tuple(i for k in ("eot_token_id", "eom_token_id") if (i := token_id(k)) is not None)
    template = value("tokenizer.chat_template")
    if template is not None and type(template) is not str:
        raise TokenizerError(f"{path!r}: tokenizer.chat_template = {_short(template)} is not a string")
    return GGUFVocab(path=path, architecture=arch, model=model, tokens=tokens, scores=scores,
                     token_types=types, bos_id=token_id("bos_token_id"),
                     eos_id=token_id("eos_token_id"), unk_id=token_id("unknown_token_id"),
                     pad_id=token_id("padding_token_id"), extra_eos_ids=extra,
                     # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
                     add_bos=flag("add_bos_token", True), add_eos=flag("add_eos_token", False),
                     add_space_prefix=flag("add_space_prefix", False), chat_template=template)


def _short(v) -> str:
    """repr(v) cut to a length an error line can hold."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _spelling(piece: str) -> str:
    """A piece as the BPE model sees it: the file keeps the pieces made only of spaces in real spaces."""
    return SPACE * len(piece) if piece and piece.strip(" ") == "" else piece


def _merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every cut of a piece into two pieces of the vocabulary, best first: by the joined piece's
    place in the file, then the longer left part first."""
    out = []
    for piece in pieces:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                out.append((left, right))
    return out


def build_backend(v: GGUFVocab):
    """A `tokenizers.Tokenizer` equal to the SentencePiece BPE vocabulary `v` describes."""
    from tokenizers import AddedToken, decoders, normalizers, processors
    from tokenizers import Tokenizer as _Tok
    from tokenizers.models import BPE

    if v.add_space_prefix:  # no Gemma file sets it; a prefix space would change every first word
        raise TokenizerError(f"{v.path!r}: tokenizer.ggml.add_space_prefix is set, which jaxspec does not "
                             "rebuild for Gemma vocabularies")
    pieces = [_spelling(t) for t in v.tokens]
    vocab: dict[str, int] = {}
    for i, p in enumerate(pieces):
        if vocab.setdefault(p, i) != i:
            raise TokenizerError(f"{v.path!r}: token {p!r} appears twice (ids {vocab[p]} and {i})")
    unk = pieces[v.unk_id] if v.unk_id is not None else None
    model = BPE(vocab=vocab, merges=_merges(pieces, vocab), unk_token=unk, fuse_unk=True, byte_fallback=True,
                dropout=None)
    tok = _Tok(model)
    # Not pre-split: one word per stretch of text between added tokens, spaces included.
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    types = v.token_types
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(v.tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, p, k in zip(v.tokens, pieces, types)
            if k == USER_DEFINED and t == p]  # the respelled space runs stay BPE pieces
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(pieces):
        raise TokenizerError(f"{v.path!r}: rebuilding the vocabulary gave {tok.get_vocab_size(True):,} tokens, "
                             f"not the file's {len(pieces):,}")
    single, pair, special = "$A:0", "$A:0 $B:1", {}
    if v.add_bos and v.bos_id is not None:
        bos = v.tokens[v.bos_id]
        single, pair, special[bos] = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1", v.bos_id
    if v.add_eos and v.eos_id is not None:
        eos = v.tokens[v.eos_id]
        single, pair, special[eos] = f"{single} {eos}:0", f"{pair} {eos}:1", v.eos_id
    if special:
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=list(special.items()))
    return tok


def tokenizer_from_gguf(path: str, reader=None) -> Tokenizer:
    """jaxspec's Tokenizer for the GGUF at `path`: its special tokens, its stop ids (EOS, plus the
    end-of-turn tokens the file names) and its chat template, if it has one."""
    path = os.fspath(path)
    v = read_vocab(path, reader)
    names = {"bos_token": v.bos_id, "eos_token": v.eos_id, "pad_token": v.pad_id, "unk_token": v.unk_id}
    special = {k: v.tokens[i] for k, i in names.items() if i is not None}
    eos = ([v.eos_id] if v.eos_id is not None else []) + list(v.extra_eos_ids)
    return Tokenizer(build_backend(v), special_tokens=special, chat_template=v.chat_template, eos_token_ids=eos,
                     source=path)
