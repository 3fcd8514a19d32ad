"""Tokenizer handling: a model directory's `tokenizer.json` (HF `tokenizers`), its chat template,
its stop tokens, and incremental (streaming) detokenization.

    tok = jaxspec.text.load_tokenizer("path/to/model")       # reads tokenizer.json (+ configs)
    ids = tok.encode("def fibonacci(n):")                         # BOS added as tokenizer.json says
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    text = tok.decode(ids)

The files read from the directory, all optional except tokenizer.json:

* `tokenizer.json`: the fast tokenizer (vocabulary, merges, normalizer, post-processor).
* `tokenizer_config.json`: special tokens (`bos_token`, `eos_token`, ...) and, in older
  checkpoints, `chat_template` (a string, or a list of named templates: "default" is used).
* `chat_template.jinja` / `chat_template.json`: the chat template in newer HF checkpoints.
* `config.json` / `generation_config.json`: `eos_token_id` (an int or a list; Gemma's
  instruction-tuned checkpoints list the end-of-turn token there as well). When nothing declares an
  EOS, a token named `<eos>`, `</s>` or `<|endoftext|>` is taken.

A pair directory (`PAIR/target`, `PAIR/assistant`, as the embedded default pair is laid out) may
keep one `PAIR/tokenizer.json` for both: it is used when the member directory has none.

A GGUF file (`load_tokenizer("model.gguf")`, or a directory holding one and no tokenizer.json)
carries its tokenizer in its metadata: jaxspec.text.gguf rebuilds it. `Tokenizer.save(dir)`
writes any tokenizer as tokenizer.json + tokenizer_config.json, so a converted checkpoint
directory needs no GGUF to tokenize.

Chat templates are rendered by jaxspec.text.chat_template; loading (tokenizer.json or GGUF) is
jaxspec.text.load's `load_tokenizer`.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

from jaxspec.models.checkpoint_files import FileProblem, located, read_regular

from jaxspec.text.chat_template import TokenizerError, render_chat_template  # noqa: F401  (TokenizerError: named here too)

TOKENIZER_FILE = "tokenizer.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_text(path: str) -> str:
    """A regular file's text (never blocking on a FIFO); TokenizerError naming the path otherwise."""
    try:
        return read_regular(path).decode("utf-8")
    except FileProblem as e:
        raise TokenizerError(str(e)) from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path!r} is not UTF-8 text ({e})") from None


def _read_json(path: str) -> dict | None:
    """An optional JSON file: None when nothing is at `path`; whatever is there must be readable."""
    if not os.path.lexists(path):
        return None
    try:
        d = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None
    return d if isinstance(d, dict) else None


def _token_str(v) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _ids(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, bool):
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def find_chat_template(model_dir: str, tokenizer_config: dict | None = None) -> str | None:
    """The chat template of a model directory, or None: `chat_template.jinja`, then
    `chat_template.json`, then `tokenizer_config.json`'s `chat_template`."""
    path = located(model_dir, "chat_template.jinja")
    if os.path.lexists(path):
        return _read_text(path)
    d = _read_json(located(model_dir, "chat_template.json"))
    if d and isinstance(d.get("chat_template"), str):
        return d["chat_template"]
    tc = tokenizer_config if tokenizer_config is not None else _read_json(
        located(model_dir, "tokenizer_config.json"))
    t = (tc or {}).get("chat_template")
    if isinstance(t, str):
        return t
    if isinstance(t, list):  # [{"name": "default", "template": "..."}, ...]
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
        return named.get("default") or next((v for v in named.values() if isinstance(v, str)), None)
    return None


_CONVENTIONAL_EOS = ("<eos>", "</s>", "<|endoftext|>")
PAIR_MEMBERS = ("target", "assistant")


def _find_tokenizer_file(model_dir: str) -> str:
    """model_dir/tokenizer.json; for a member of a pair directory (PAIR/target, PAIR/assistant)
    without one, the pair's shared PAIR/tokenizer.json."""
    path = located(model_dir, TOKENIZER_FILE)
    if os.path.lexists(path):  # whatever is there: from_dir names it if it is not a readable file
        return path
    norm = os.path.normpath(os.path.abspath(model_dir))
    shared = os.path.join(os.path.dirname(norm), TOKENIZER_FILE)
    if os.path.basename(norm) in PAIR_MEMBERS and os.path.lexists(shared):
        return shared
    return path


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the model directory says about special tokens, stop ids
    and the chat template. Construct with `load_tokenizer(dir)` or `Tokenizer(tokenizers_obj)`."""

    def __init__(self, tokenizer, *, special_tokens: dict[str, str] | None = None,
                 chat_template: str | None = None, eos_token_ids: Sequence[int] = (), source: str | None = None):
        self.backend = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.source = source
        ids = list(eos_token_ids)
        eos = self.special_tokens.get("eos_token")
        if eos is not None and tokenizer.token_to_id(eos) is not None:
            ids.append(tokenizer.token_to_id(eos))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(ids)))

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str, tokenizer_file: str | None = None) -> "Tokenizer":
        """Read `tokenizer.json` (or `tokenizer_file`) and the optional config files of
        `model_dir`. Raises TokenizerError when there is no usable tokenizer file. (A GGUF source is
        `jaxspec.text.load_tokenizer`'s to dispatch: jaxspec.text.gguf rebuilds its tokenizer.)"""
        from tokenizers import Tokenizer as _Tok

        model_dir = os.fspath(model_dir)  # a pathlib.Path too
        tokenizer_file = None if tokenizer_file is None else os.fspath(tokenizer_file)
        path = tokenizer_file or _find_tokenizer_file(model_dir)
        if not os.path.lexists(path):
            raise TokenizerError(f"no {TOKENIZER_FILE} in {model_dir!r} (pass --tokenizer FILE)"
                                 if tokenizer_file is None else f"tokenizer file {path!r} does not exist")
        text = _read_text(path)  # read here, regular files only: from_file would block on a FIFO
        try:
            backend = _Tok.from_str(text)
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise TokenizerError(f"{path!r} is not a tokenizers JSON file: {str(e).splitlines()[0]}") from None
        tc = _read_json(located(model_dir, "tokenizer_config.json")) or {}
        special = {k: s for k in _SPECIAL_KEYS if (s := _token_str(tc.get(k))) is not None}
        eos: list[int] = []
        for name in ("config.json", "generation_config.json"):
            d = _read_json(located(model_dir, name)) or {}
            eos += _ids(d.get("eos_token_id"))
            eos += _ids((d.get("text_config") or {}).get("eos_token_id"))
        if not eos and "eos_token" not in special:  # nothing declared: the conventional name, if any
            for name in _CONVENTIONAL_EOS:
                if backend.token_to_id(name) is not None:
                    eos.append(backend.token_to_id(name))
                    break
        return cls(backend, special_tokens=special, chat_template=find_chat_template(model_dir, tc),
                   eos_token_ids=eos, source=path)

    # ---- encode / decode -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies tokenizer.json's post-processor (BOS
        for Gemma). Pass False for text that already has them (a rendered chat template)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat ------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
        """Render `messages` ([{"role": "user", "content": "..."}, ...]) with the model's chat
        template. The result normally starts with the BOS token: encode it with
        `add_special_tokens=False`."""
        if self.chat_template is None:
            if is_gguf(self.source or ""):
                raise TokenizerError(f"{self.source} has no chat template (no tokenizer.chat_template in its "
                                     "metadata; a base model?): prompt it with plain text, without --chat")
            raise TokenizerError("this model directory has no chat template (chat_template.jinja, "
                                 "chat_template.json or tokenizer_config.json's chat_template)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    **self.special_tokens, **extra)

    def encode_chat(self, messages: list[dict] | str, **kw) -> list[int]:
        """`encode(apply_chat_template(messages), add_special_tokens=False)`; a string is one
        user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.encode(self.apply_chat_template(messages, **kw), add_special_tokens=False)

    # ---- saving ----------------------------------------------------------------------------
    def save(self, directory: str) -> list[str]:
        """Write `directory/tokenizer.json` and `directory/tokenizer_config.json` (the special
        tokens and the chat template, if any), each whole or not at all, so that
        `load_tokenizer(directory)` gives this tokenizer back. Stop ids other than the EOS token's
        are the model config's to list (config.json's `eos_token_id`). Returns the paths written."""
        os.makedirs(directory, exist_ok=True)
        config = dict(self.special_tokens)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        written = []
        for name, text in ((TOKENIZER_FILE, self.backend.to_str()),
                           ("tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")):
            path = os.path.join(directory, name)
            tmp = f"{path}.tmp{os.getpid()}"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(tmp, path)
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
            written.append(path)
        return written

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source or 'in memory'}, vocab={self.vocab_size}, "
                f"eos={list(self.eos_token_ids)}, chat_template={'yes' if self.chat_template else 'no'})")


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


class IncrementalDecoder:
    """Turns a growing token sequence into text pieces for streaming.

    `push(ids)` returns the text that is final so far. Text whose last characters may still change
    (an incomplete UTF-8 sequence: byte-level BPE splits multi-byte characters over tokens) is held
    back until a later token completes it; `flush()` returns the rest. The concatenation of all
    pieces equals `tokenizer.decode(all_ids)`."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters of the full decode already returned

    def push(self, ids: Iterable[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        end = len(text)
        while end > self.emitted and text[end - 1] == "\ufffd":  # maybe an unfinished character
            end -= 1
        if end <= self.emitted:
            return ""
        piece, self.emitted = text[self.emitted:end], end
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        piece, self.emitted = text[self.emitted:], len(text)
        return piece


# ---- building small tokenizers (tests, demos) ----------------------------------------------------
DEMO_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")

# About a kilobyte of code and prose for `train_byte_bpe([DEMO_CORPUS])`: the toy tokenizer of the tiny
# random pair (`jaxspec tiny-pair`, the quickstart). Non-ASCII text included, so multi-byte
# characters split across tokens and incremental decoding has something to hold back.
DEMO_CORPUS = """\
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

for name, value in sorted(table.items()):
    print(f"{name}: {value}")

Speculative decoding lets a small draft model propose several tokens and a large target model
check them all in one forward pass. Every draft up to the first disagreement is kept, plus one
token from the target, so the output is exactly what the target alone would have written.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: ( ) [ ] { } < > = + - * / % , . ; :
Unicode: café, naïve, über, smörgåsbord, 東京, 日本語, ☃, π ≈ 3.14159.
"""


def train_byte_bpe(texts: Iterable[str], *, vocab_size: int = 512,
                   special_tokens: Sequence[str] = DEMO_SPECIAL_TOKENS, bos_token: str | None = "<bos>"):
    """Train a small byte-level BPE `tokenizers.Tokenizer` on `texts` (for tests and demos: pair it
    with a random model of at least `vocab_size` tokens). The special tokens get ids 0, 1, 2, ...
    (by default pad 0, eos 1, bos 2, the tiny presets' ids); `bos_token` is prepended on encode."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer=trainer)
    if bos_token is not None:
        bos = tok.token_to_id(bos_token)
        tok.post_processor = processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A $B",
                                                           special_tokens=[(bos_token, bos)])
    return tok
