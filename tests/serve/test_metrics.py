"""/metrics and prefix reuse through the server (issue 70; in process, the tiny pair, the official
`openai` client): the text parses with prometheus_client's parser, and its counters move as
requests run (prompt tokens queried and found cached, generated tokens = the responses' usage, one
time-to-first-token per request, inter-token latencies, the pool's blocks back to cached and free);
the same prompt twice and a prompt sharing its start give the text a server without reuse
(`--no-prefix-cache`) gives, which finds nothing cached; the CLI flag turns reuse off."""
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
parser = pytest.importorskip("prometheus_client.parser")

from jaxspec import cli, models  # noqa: E402
from jaxspec.serve.app import Server  # noqa: E402
from jaxspec.text.tokenizer import DEMO_CORPUS, Tokenizer, train_byte_bpe  # noqa: E402
from support.seeds import seeded_rng  # noqa: E402
from support.serve_inproc import serving  # noqa: E402

TARGET, ASSISTANT = models.presets.tiny_pair(seed=0)
TOK = Tokenizer(train_byte_bpe([DEMO_CORPUS], vocab_size=TARGET.config.vocab_size))
CHUNK = 32


def _metrics(url) -> dict:
    """{sample name with its labels: value} of GET /metrics, through prometheus_client's parser."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def _prompts(rng):
    """Three texts: one, the same again, one sharing its first ~100 characters; each well over two
    prefill chunks of tokens."""
    words = DEMO_CORPUS.split()
    pick = lambda n: " ".join(words[int(i)] for i in rng.integers(0, len(words), n))  # noqa: E731
    head = pick(60)
    return [head + " " + pick(8), head + " " + pick(8), head + " " + pick(8)]


def test_metrics_move_and_reuse_changes_no_text():
    rng = seeded_rng()
    prompts = _prompts(rng)
    prompts[1] = prompts[0]
    texts, stats = [], []
    for reuse in (True, False):
        srv = Server(TARGET, ASSISTANT, TOK, model_name="m", max_batch=1, prefill_chunk=CHUNK, prefix_cache=reuse)
        with serving(srv.app()) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            before = _metrics(url)
            assert before["jaxspec_generated_tokens_total"] == 0 and before["jaxspec_queue_depth"] == 0
            out, used = [], 0
            for p in prompts:
                r = client.completions.create(model="m", prompt=p, max_tokens=12, temperature=0)
                out.append(r.choices[0].text)
                used += r.usage.completion_tokens
            after = _metrics(url)
        srv.close()
        texts.append(out)
        n_ids = [len(TOK.encode(p)) for p in prompts]
        assert min(n_ids) > 2 * CHUNK  # every prompt holds a chunk boundary a hit may end at
        assert after["jaxspec_prefix_cache_queried_tokens_total"] == sum(n_ids)
        assert after["jaxspec_generated_tokens_total"] == used > 0
        assert after["jaxspec_time_to_first_token_seconds_count"] == 3
        assert after["jaxspec_time_to_first_token_seconds_bucket{le=+Inf}"] == 3
        assert after["jaxspec_time_to_first_token_seconds_sum"] > 0
        assert after["jaxspec_inter_token_latency_seconds_count"] == used - 3  # every token after a first
        assert after["jaxspec_requests_served_total"] == 3
        assert after["jaxspec_running_requests"] == 0 and after["jaxspec_queue_depth"] == 0
        blocks = {s: after[f"jaxspec_kv_blocks{{state={s}}}"] for s in ("used", "cached", "free")}
        assert blocks["used"] == 0 and sum(blocks.values()) == after["jaxspec_kv_blocks_total"] > 0
        stats.append((after["jaxspec_prefix_cache_hit_tokens_total"], blocks["cached"],
                      after["jaxspec_prefix_cache_hit_rate"]))
    assert texts[0] == texts[1]  # greedy: reuse changes no byte
    (hit, cached, rate), (hit_off, cached_off, rate_off) = stats
    # the repeat finds every whole chunk below its last token; the third at least the shared chunks
    assert hit >= (n_ids[0] - 1) // CHUNK * CHUNK + CHUNK and cached > 0
    assert rate == pytest.approx(hit / sum(n_ids))
    assert (hit_off, cached_off, rate_off) == (0, 0, 0.0)


def test_the_flag_turns_reuse_off():
    args = cli.build_parser().parse_args(["serve", "--no-prefix-cache"])
    assert cli._serve_config(args).prefix_cache is False
    assert cli._serve_config(cli.build_parser().parse_args(["serve"])).prefix_cache is True
    with pytest.raises(ValueError, match="prefix_cache must be True or False"):
        Server(TARGET, ASSISTANT, TOK, model_name="m", prefix_cache="no")


def test_histogram_buckets_and_counters_never_go_down():
    """A value on a bucket's bound counts in it (Prometheus' le); a gap of n tokens is n observations of
    its share; an engine the scheduler drops keeps its pool's counters in the base."""
    from jaxspec.engine.prefix_cache import BlockPool
    from jaxspec.serve.metrics import Metrics

    rng = seeded_rng()
    m = Metrics()
    bound = float(rng.choice([0.1, 0.25, 0.5]))
    m.tokens(1, first_s=bound)
    m.tokens(4, gap_s=4 * 0.003)
    pool = BlockPool(8, 16)
    pool.take([], 3)
    pool.queried, pool.hit = 100, 32
    m.retire(pool)
    fresh = BlockPool(8, 16)
    fresh.queried = 10
    text = m.render(pool=fresh, waiting=0, running=0, served=0)
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in parser.text_string_to_metric_families(text) for s in f.samples}
    assert got[("jaxspec_time_to_first_token_seconds_bucket", (("le", str(bound)),))] == 1
    below = max(b for b in (0.01, 0.025, 0.05, 0.1, 0.25) if b < bound)
    assert got[("jaxspec_time_to_first_token_seconds_bucket", (("le", str(below)),))] == 0
    assert got[("jaxspec_inter_token_latency_seconds_count", ())] == 4
    assert got[("jaxspec_inter_token_latency_seconds_bucket", (("le", "0.0025"),))] == 0
    assert got[("jaxspec_inter_token_latency_seconds_bucket", (("le", "0.005"),))] == 4
    assert got[("jaxspec_inter_token_latency_seconds_sum", ())] == pytest.approx(0.012)
    assert got[("jaxspec_prefix_cache_queried_tokens_total", ())] == 110
    assert got[("jaxspec_prefix_cache_hit_rate", ())] == pytest.approx(32 / 110)
    assert got[("jaxspec_kv_blocks", (("state", "free"),))] == 8 and got[("jaxspec_generated_tokens_total", ())] == 5
