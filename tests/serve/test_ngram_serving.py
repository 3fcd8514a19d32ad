"""Prompt-lookup drafting where users choose it: streaming (the tokens and counters of `generate`), the
batch engine (a request's tokens and accepted drafts equal `jaxspec.generate` on it alone, its
prompt prefilled in chunks), and the CLI
(`--draft ngram`: output identical to classic, the stats line names the drafter; bad combinations
are one-line errors before anything loads)."""
import re

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.engine import streaming
from jaxspec.engine.batching import BatchEngine
from support.cli_errors import one_line_error
from support.seeds import seeded_rng
from support.pairs import make_pair

TARGET, ASSISTANT = make_pair(seed=5, layers=2)
K = 4


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_streaming_equals_generate(temperature):
    """Streamed and whole, the same tokens and drafter counters, on draws until one in which the
    n-gram drafter matched (a sampled continuation may repeat none of its n-grams in 24 tokens: seen
    once in CI; every draw's run is the same programs, so the extra draws compile nothing)."""
    rng = seeded_rng()
    for _ in range(8):
        head = rng.integers(2, TARGET.config.vocab_size, 4).tolist()
        rows = [head * 3, rng.integers(2, TARGET.config.vocab_size, 7).tolist()]
        kw = dict(max_new_tokens=24, drafter="ngram", block_size=K, temperature=temperature,
                  seed=int(rng.integers(1 << 30)), eos_token_ids=[], exactness_probe=False)
        want = jaxspec.generate(TARGET, rows, **kw)
        chunks = list(streaming.stream_generate(TARGET, rows, rounds_per_chunk=2, **kw))
        got = chunks[-1].result
        assert [sum((c.tokens[b] for c in chunks), []) for b in range(2)] == got.tokens == want.tokens
        assert (got.stats.drafter, got.stats.block_size) == ("ngram", K)
        assert got.stats.accepted_hist == want.stats.accepted_hist and got.stats.draft_stats == want.stats.draft_stats
        if want.stats.draft_stats["matched_rounds"] > 0:
            break
    assert want.stats.draft_stats["matched_rounds"] > 0  # the drafter drafted: the comparison was not vacuous


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_engine_requests_equal_generate_alone(drafter):
    """Prompts that hold their own classic continuation (so drafts come from them), longer than a
    prefill chunk: each request's tokens are classic decoding's, and its accepted drafts are
    generate's with the same drafter alone, so the engine's history holds every chunk of the prompt
    (hybrid: the assistant drafts the rounds lookup does not, in the slots' batch)."""
    assistant = ASSISTANT if drafter == "hybrid" else None
    rng = seeded_rng()
    vocab = TARGET.config.vocab_size
    heads = rng.integers(2, vocab, (3, 5)).tolist()
    conts = jaxspec.generate(TARGET, heads, max_new_tokens=32, eos_token_ids=[]).tokens
    # one prompt width bucket (33..48 tokens) and one budget bucket: the runs alone are two programs
    requests = [(h + c[:30], n) for h, c, n in zip(heads, conts, (20, 9, 24))] + [(heads[1] + conts[1][:28], 12)]
    requests.append((rng.integers(2, vocab, 40).tolist(), 16))  # copies nothing: the hybrid's assistant drafts
    engine = BatchEngine(TARGET, assistant, slots=2, max_new_tokens=24, capacity=96, block_size=K, drafter=drafter,
                         prefill_chunk=16, eos_token_ids=[])
    assert (engine.block_size, engine.drafter.kind, engine.fallback) == (K, drafter, None)
    waiting, got, accepted, where = list(enumerate(requests)), {}, {}, {}
    while waiting or engine.live:
        while waiting and engine.free:
            i, (ids, n) = waiting.pop(0)
            where[engine.admit(ids, n, owner=i)] = i
            got[i] = []
        for ev in engine.step():
            got[where[ev.slot]] += ev.tokens
            accepted[where[ev.slot]] = ev.accepted
    assert engine.chunks > len(requests)  # some prompts took several chunks
    assisted = 0
    for i, (ids, n) in enumerate(requests):
        classic = jaxspec.generate(TARGET, [ids], max_new_tokens=n, eos_token_ids=[])
        alone = jaxspec.generate(TARGET, [ids], assistant=assistant, max_new_tokens=n, eos_token_ids=[], drafter=drafter,
                                 block_size=K, exactness_probe=False)
        assert got[i] == classic.tokens[0] == alone.tokens[0], f"request {i}"
        assert accepted[i] == alone.stats.accepted, f"request {i}"
        assisted += alone.stats.draft_stats.get("assisted_rounds", 0)
    assert sum(accepted.values()) > 0
    assert (assisted > 0) == (drafter == "hybrid")


def test_cli_generate_draft_ngram(pair, capsys):
    target_dir, _ = pair
    rc = cli.main(["generate", "def f(x):\n    return x + 1\n\ndef f(x):\n", "--model", target_dir, "--draft", "ngram",
                   "--compare", "--max-tokens", "24", "--dtype", "float32", "--no-compile-cache"])
    out = capsys.readouterr().out
    assert rc == 0
    line = out.strip().splitlines()[-1]
    assert re.match(r"stats: speculative K=4 \| \d+ new tokens .*\| drafter ngram, matched rounds \d+, "
                    r"accepted from prompt \d+, accepted from output \d+ \|.*"
                    r"greedy output identical to classic: yes$", line), line


def test_cli_draft_errors(pair, capsys):
    target_dir, assistant_dir = pair
    err = one_line_error(capsys, "generate", "hi", "--model", target_dir, "--assistant", assistant_dir, "--draft",
                         "ngram")
    assert "--draft ngram drafts from the prompt, without an assistant" in err
    for draft in ("mtp", "hybrid"):
        err = one_line_error(capsys, "generate", "hi", "--model", target_dir, "--draft", draft)
        assert f"--draft {draft} needs an assistant" in err
    err = one_line_error(capsys, "serve", "--model", target_dir, "--draft", "hybrid")
    assert "--draft hybrid needs an assistant" in err
