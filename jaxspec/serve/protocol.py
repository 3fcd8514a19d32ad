"""The OpenAI API's schema, both ways: a request body -> jaxspec's request (`sampling.SamplingParams`)
and the prompt's token ids, refused with OpenAI's error JSON (`ApiError`, a 4xx) before anything
runs; and the response objects (usage, logprobs). No model, no thread: `jaxspec.serve.app` holds one
`OpenAISchema` and routes to it, `jaxspec.serve.scheduler` runs what it returns.
"""
from __future__ import annotations

import json
import math
import random

from jaxspec.engine import sampling
from jaxspec.serve.guard import error_json, shown
from jaxspec.text.tokenizer import TokenizerError


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return error_json(self.message, code=self.code, param=self.param)


# ---- validation ------------------------------------------------------------------------------
MAX_STOP_CHARS = sampling.MAX_STOP_CHARS  # per stop string
TEMPERATURE_MAX = 2.0  # OpenAI's bound (the library has none)

# Fields a request may carry; the values that change nothing are accepted for the others
# (`_NEUTRAL`); anything else is a 400 naming the field, never silently ignored.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options",
           "n", "logit_bias", "user", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs"}
_FIELDS = {False: _COMMON | {"prompt", "echo", "best_of", "suffix"},
           True: _COMMON | {"messages", "top_logprobs", "max_completion_tokens"}}
_NEUTRAL = {"echo": (False,), "best_of": (1,), "suffix": ("",)}


def _check_fields(body: dict, chat: bool) -> None:
    for name in body:
        if name not in _FIELDS[chat]:
            raise ApiError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    for name, ok in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and (isinstance(v, bool) != isinstance(ok[0], bool) or v not in ok):
            raise ApiError(400, f"'{name}' is not supported by this server (only {ok[0]!r})", name,
                           "unsupported_parameter")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_usage"}
                                 and isinstance(opts.get("include_usage", True), bool)):
        raise ApiError(400, "'stream_options' may only hold include_usage (a boolean)", "stream_options")


def _number(body, name, default, lo, hi, *, integer=False, lo_open=False):
    """A numeric field in its range. An integer is compared as it is (a JSON integer may have hundreds
    of digits: no float conversion, which overflows past 1e308), a float checked finite first."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        ok = False
    else:
        ok = (isinstance(v, int) or math.isfinite(v)) and lo <= v <= hi and not (lo_open and v == lo)
    if not ok:
        kind = "an integer" if integer else "a number"
        rng = f"in ({lo}, {hi}]" if lo_open else f"in [{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be {kind} {rng}, got {shown(v)}", name)
    return v


def _knob(body, name, default, knob=None, hi=None):
    """A request knob's field, in its range from `sampling.RANGES` (`hi`: a lower upper bound)."""
    r = sampling.RANGES[knob or name]
    return _number(body, name, default, r.lo, r.hi if hi is None else hi, integer=r.integer, lo_open=r.lo_open)


def _stops(body) -> list[str]:
    """The stop strings: null, a string or a list of strings (a value of another type is a 400, never
    dropped: the client would get text past where it asked to stop)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if not isinstance(stop, (str, list)):
        raise ApiError(400, f"'stop' must be a string or a list of strings, got {shown(stop)}", "stop")
    try:
        return list(sampling.validate_stop(stop))
    except ValueError as e:
        raise ApiError(400, f"'stop' {str(e).removeprefix('stop ')}, got {shown(stop)}", "stop") from None


def _logit_bias(body, vocab: int) -> tuple:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
    pairs = []
    for k, v in bias.items():
        t = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) < 12 else -1
        if not 0 <= t < vocab:
            raise ApiError(400, f"'logit_bias' keys must be token ids in [0, {vocab}), got {shown(k)}", "logit_bias")
        pairs.append((t, v))
    try:
        return sampling.validate_bias(pairs)
    except ValueError as e:
        raise ApiError(400, f"'logit_bias': {e}", "logit_bias") from None


def _check_text(body: dict) -> None:
    """400 for a lone surrogate anywhere in the body (JSON's "\\ud800" escape parses to one): no text
    holding one can be encoded as UTF-8, so the tokenizer (and the reply) would fail on it."""
    todo = [(name, v) for name, v in body.items()]
    while todo:
        name, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"'{name}' holds a lone surrogate U+{ord(v[e.start]):04X} at character {e.start}: "
                                    "text must be valid Unicode (UTF-8 encodable)", name) from None
        elif isinstance(v, dict):
            todo += [(name, x) for x in v.values()] + [(name, k) for k in v]
        elif isinstance(v, list):
            todo += [(name, x) for x in v]


def max_token_bytes(tok) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token stands for: the longest vocabulary entry
    (byte-level and SentencePiece entries are at least as long as their text), doubled when the
    tokenizer normalizes text first (a normalizer may shorten it). None when the vocabulary cannot
    be read."""
    try:
        backend = tok.backend
        longest = max(len(t.encode("utf-8", "replace")) for t in backend.get_vocab(with_added_tokens=True))
        return max(1, longest) * (2 if backend.normalizer is not None else 1)
    except Exception:  # a tokenizer without a readable vocabulary: no bound
        return None


def parse_body(raw: bytes):
    """The JSON body; a 400 for anything json cannot read (bad syntax or encoding, a 5000-digit
    integer, nesting past the recursion limit)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None


def capacity_note(capacity: int, pool: int | None) -> str:
    """What bounds the cache positions of one request, for a 400: a request's own capacity, or the
    KV pool the slots share where that is smaller (with the flag that sizes it)."""
    if pool is not None and pool < capacity:
        return (f"the KV pool the slots share holds {pool} positions, fewer than a request's {capacity}: "
                "jaxspec serve --kv-positions sets it")
    return f"{capacity} positions per request" + ("" if pool is None else f", {pool} in the KV pool")


class OpenAISchema:
    """The server's side of the API for one model: `request(raw, chat)` parses a body into the prompt's
    ids, the request and whether to stream; `usage` and `logprobs_json` build the response parts.
    `slot_room` (set after the server's warm-up: prompt length -> the largest budget a batch slot
    takes) turns a request that fits no slot into a 400; `kv_pool` (set with it: the positions of
    the KV pool the slots share) is named in it when the pool is what bounds the request."""

    def __init__(self, tok, *, model_name: str, vocab: int, context: int | None, batch_capacity: int,
                 batch_tokens: int, aliases: tuple[str, ...] = ()):
        self.tok, self.model_name, self.vocab, self.context = tok, model_name, vocab, context
        self.aliases = tuple(aliases)  # other names a request may give the model (e.g. its file's)
        self.batch_capacity, self.batch_tokens = batch_capacity, batch_tokens
        # Text past context x this many bytes cannot fit: refused before the tokenizer sees it (64
        # concurrent 1 MB prompts, all tokenized, froze /health for 14.8 s: issue 51).
        self.token_bytes = max_token_bytes(tok)
        self.slot_room = None  # after warm_up: prompt length -> the largest budget a slot takes
        self.kv_pool = None  # after warm_up: the positions of the KV pool the slots share

    def request(self, raw: bytes, chat: bool) -> tuple[list[int], sampling.SamplingParams, bool, int]:
        """A request body -> (prompt ids, the request, stream, n: the choices asked); ApiError for
        anything wrong, before any compute. The request carries the budget, the seed (a random one
        when the body has none), the stop strings and the logprobs."""
        body = parse_body(raw)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        _check_fields(body, chat)
        _check_text(body)
        model = body.get("model")
        if model is not None and model != self.model_name and model not in self.aliases:
            also = "".join(f" (also named {shown(a)})" for a in self.aliases)
            raise ApiError(404, f"the model {shown(model)} does not exist: this server serves "
                                f"{shown(self.model_name)}{also}", "model", "model_not_found")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", "stream")
        temperature = _knob(body, "temperature", 0.0, hi=TEMPERATURE_MAX)
        if 0 < temperature < sampling.MIN_TEMPERATURE:
            raise ApiError(400, f"'temperature' must be 0 (greedy) or in [{sampling.MIN_TEMPERATURE}, 2]",
                           "temperature")
        top_p = _knob(body, "top_p", None)
        top_k = _knob(body, "top_k", None)
        min_p = _knob(body, "min_p", None)
        presence = _knob(body, "presence_penalty", 0.0)
        frequency = _knob(body, "frequency_penalty", 0.0)
        repetition = _knob(body, "repetition_penalty", 1.0)  # an extension (vLLM's, HF's)
        n = _knob(body, "n", 1)
        seed = _knob(body, "seed", None)
        logprobs = self._logprobs(body, chat)
        bias = _logit_bias(body, self.vocab)
        stop = _stops(body)
        ids = self._chat_ids(body) if chat else self._prompt_ids(body)
        what = "messages" if chat else "prompt"
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", what)
        room = None if self.context is None else self.context - len(ids)
        if room is not None and room < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, longer than the model's context of "
                                f"{self.context} tokens", what, "context_length_exceeded")
        default = 256 if chat else 16  # completions: OpenAI's default; chat: a bounded stand-in for "the rest"
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        slot = None if self.slot_room is None else self.slot_room(len(ids))
        if slot is not None and slot < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens, more than a batch slot of this server holds for "
                                f"prompt and output ({capacity_note(self.batch_capacity, self.kv_pool)})", what,
                           "exceeds_batch_slot")
        default = min(default, room or default, slot or default)
        max_tokens = _knob(body, name, default, "max_new_tokens", hi=room or 1 << 20)
        if slot is not None and max_tokens > slot:
            # Running it alone would compile its programs while every other client waits.
            raise ApiError(400, f"'{name}' {max_tokens} does not fit a batch slot of this server: with this "
                                f"{len(ids)}-token prompt at most {slot} (at most {self.batch_tokens} new tokens; "
                                f"{capacity_note(self.batch_capacity, self.kv_pool)})", name, "exceeds_batch_slot")
        if seed is None:  # as OpenAI: without a seed, sampling differs from call to call
            seed = random.getrandbits(63)
        try:  # the fields were checked above (naming them as the client spelled them): this cannot fail
            params = sampling.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                             logit_bias=bias, presence_penalty=presence, frequency_penalty=frequency,
                                             repetition_penalty=repetition,
                                             max_new_tokens=max_tokens, seed=seed, stop=stop, logprobs=logprobs)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return ids, params, stream, n

    @staticmethod
    def _logprobs(body, chat: bool) -> int | None:
        """Alternatives per token to report, or None. Completions: `logprobs` N; chat: `logprobs`
        true with `top_logprobs` N."""
        if not chat:
            return _knob(body, "logprobs", None)
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise ApiError(400, "'logprobs' must be a boolean", "logprobs")
        n = _knob(body, "top_logprobs", None, "logprobs")
        if n is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (n or 0) if on else None

    def _check_length(self, texts, what: str) -> None:
        """400 for text more bytes long than a context-full of the longest tokens: it cannot fit, and
        is refused without tokenizing it."""
        if self.token_bytes is None or self.context is None:
            return
        n = sum(len(t.encode("utf-8")) for t in texts)
        if n > self.context * self.token_bytes:
            raise ApiError(400, f"the {what} is {n} bytes of text, more than the model's context of {self.context} "
                                f"tokens can hold (a token stands for at most {self.token_bytes} bytes)", what,
                           "context_length_exceeded")

    def _prompt_ids(self, body) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_length([prompt], "prompt")
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if min(prompt) < 0 or max(prompt) >= self.vocab:
                raise ApiError(400, f"token ids must be in [0, {self.vocab})", "prompt")
            return list(prompt)
        raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids", "prompt")

    def _chat_ids(self, body) -> list[int]:
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects with string "
                                "content", "messages")
        for i, m in enumerate(messages):
            extra = sorted(set(m) - {"role", "content"})
            if extra:  # a field the template never sees: dropping it would change the conversation silently
                raise ApiError(400, f"'messages[{i}]' has {', '.join(repr(k[:40]) for k in extra[:5])}, which this "
                                    "server does not use (only role and content)", "messages",
                               "unsupported_parameter")
        self._check_length([m["content"] for m in messages] + [m["role"] for m in messages], "messages")
        try:
            return self.tok.encode_chat([{"role": m["role"], "content": m["content"]} for m in messages])
        except TokenizerError as e:
            raise ApiError(400, f"this model cannot chat: {e}", "messages") from None

    @staticmethod
    def choice_seed(seed: int, i: int) -> int:
        """Choice i's seed: the request's + i (mod 2**64, the seeds' range), so choice i is what a
        request of n = 1 with that seed gives."""
        return (seed + i) % sampling.SEED_LIMIT

    @staticmethod
    def usage(n_prompt: int, n: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

    def logprobs_json(self, entries, chat: bool, offset: int = 0):
        """OpenAI's logprobs object for `entries` [(id, text end, logprob, [(id, logprob), ...])]:
        chat's {"content": [...]}, completions' parallel lists (text_offset from `offset`)."""
        piece = lambda t: self.tok.decode([t], skip_special_tokens=False)  # noqa: E731
        if chat:
            def item(t, lp):
                s = piece(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            return {"content": [item(t, lp) | {"top_logprobs": [item(a, alp) for a, alp in alts]}
                                for t, _, lp, alts in entries], "refusal": None}
        tokens = [piece(t) for t, _, _, _ in entries]  # each decoded once: offsets and strings
        offsets, at, tops = [], offset, []
        for s, (_, _, _, alts) in zip(tokens, entries):
            offsets.append(at)
            at += len(s)
            top: dict = {}
            for a, alp in alts:  # most likely first: a string two byte tokens share keeps the larger
                top.setdefault(piece(a), alp)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [lp for _, _, lp, _ in entries], "top_logprobs": tops,
                "text_offset": offsets}
