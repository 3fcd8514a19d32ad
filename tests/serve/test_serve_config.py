"""`jaxspec serve`'s knobs (jaxspec.serve.config): one range table, which `ServeConfig`, `Server`'s
keywords, the CLI's flags and the batch engine (prefill_chunk, step_tokens) all enforce: a value past a bound is
refused by each, in one line naming the field (the flag, for the CLI) and its range, before a model
is touched or loaded; the bounds themselves pass. A full queue: the scheduler's `QueueFull` (no
HTTP in it), a 429 through the app with Retry-After, as the official `openai` client sees it, and
the server serves on. No program is compiled."""
import asyncio
import socket

import jax
import pytest

pytest.importorskip("fastapi")

from jaxspec import cli, models  # noqa: E402
from jaxspec.engine import sampling  # noqa: E402
from jaxspec.engine.batching import BatchEngine  # noqa: E402
from jaxspec.serve.app import ApiError, Job, Server  # noqa: E402
from jaxspec.serve.config import RANGES, ServeConfig  # noqa: E402
from jaxspec.serve.guard import Guard  # noqa: E402
from jaxspec.serve.scheduler import QueueFull  # noqa: E402
from jaxspec.text.tokenizer import DEMO_CORPUS, train_byte_bpe  # noqa: E402
from support.no_model import NoModel  # noqa: E402
from support.serve_cli import serve_fails  # noqa: E402
from support.seeds import seeded_int  # noqa: E402
from support.serve_inproc import serving  # noqa: E402

# Each knob's flag and range as docs/serve.md states them, written out here rather than read from the
# table: (field, flag, lowest, highest, a multiple of)
DOCUMENTED = [("block_size", "--block-size", 1, 16, 1),
              ("max_batch", "--max-batch", 1, 4096, 1),
              ("rounds_per_chunk", "--rounds-per-chunk", 1, 64, 1),
              ("max_queue", "--max-queue", 1, 100_000, 1),
              ("kv_positions", "--kv-positions", 16, 1 << 26, 16),
              ("prefill_chunk", "--prefill-chunk", 16, 1 << 16, 16),
              ("step_tokens", "--step-tokens", 16, 1 << 20, 16),
              ("max_context", "--max-context", 16, 1 << 20, 16),
              ("ring_snapshots", "--ring-snapshots", 1, 4096, 1)]


def out_of_range():
    """(field, flag, value, range text) per bound a value can miss: under, over, between multiples."""
    for name, flag, lo, hi, every in DOCUMENTED:
        yield name, flag, lo - 1, f"{lo}..{hi}"
        yield name, flag, hi + every, f"{lo}..{hi}"
        if every > 1:
            yield name, flag, lo + every // 2, f"a multiple of {every}"


BAD = list(out_of_range())


def test_the_table_is_the_documented_one():
    assert {name: (k.lo, k.hi, k.multiple) for name, k in RANGES.items()} == {
        name: (lo, hi, every) for name, _, lo, hi, every in DOCUMENTED}


@pytest.mark.parametrize("name, flag, value, rng", BAD, ids=[f"{b[0]}={b[2]}" for b in BAD])
def test_each_entry_point_refuses_a_value_out_of_range(capsys, name, flag, value, rng):
    with pytest.raises(ValueError) as config_error:
        ServeConfig(**{name: value})
    message = str(config_error.value)
    assert message.startswith(f"{name} must be ") and rng in message and message.endswith(f"got {value}")
    # the server's keywords, alone or over a config: the same error, before the model is touched
    with pytest.raises(ValueError) as e:
        Server(NoModel(), None, None, model_name="m", **{name: value})
    assert str(e.value) == message
    with pytest.raises(ValueError) as e:
        Server(NoModel(), None, None, ServeConfig(), model_name="m", **{name: value})
    assert str(e.value) == message
    # the CLI: one line naming the flag, exit status 2, before anything loads
    err = serve_fails(capsys, flag, str(value))
    assert err.startswith(f"jaxspec: error: {flag} {value}: expected ") and rng in err, err


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("name, flag, lo, hi, every", DOCUMENTED, ids=[d[0] for d in DOCUMENTED])
def test_the_bounds_and_a_value_between_pass_everywhere(name, flag, lo, hi, every):
    between = lo + every * seeded_int((hi - lo) // every + 1)
    for value in (lo, hi, between):
        assert getattr(ServeConfig(**{name: value}), name) == value
        args = cli.build_parser().parse_args(["serve", flag, str(value), "--port", free_port()])
        cli._check_serve_flags(args)  # no UsageError
        assert getattr(cli._serve_config(args), name) == value


def test_slots_and_positions_left_open_are_the_machines():
    """A CPU serves one slot and 4,096 positions a request unless told otherwise (a GPU 4 and
    32,768); a named value stays, on any machine; the server and the CLI resolve the same way."""
    assert ServeConfig().resolved("cpu") == ServeConfig(max_batch=1, max_context=4096)
    assert ServeConfig().resolved("gpu") == ServeConfig(max_batch=4, max_context=32768)
    slots, context = seeded_int(2, 64), 16 * seeded_int(1, 4096)
    for platform in ("cpu", "gpu"):
        named = ServeConfig(max_batch=slots, max_context=context)
        assert named.resolved(platform) == named
    assert ServeConfig(max_batch=slots).resolved("cpu").max_context == 4096
    # a request's positions and budget follow max_context, within the model's context
    cpu = ServeConfig().resolved("cpu")
    assert cpu.request_capacity(32768) == 4096 and cpu.request_capacity(1024) == 1024
    assert cpu.request_tokens(32768) == 2048
    assert ServeConfig(max_context=context).resolved("cpu").request_capacity(1 << 20) == context
    with pytest.raises(ValueError, match="resolve the config first"):
        ServeConfig().request_capacity(32768)
    # this machine: what the CLI passes the server, resolved by the backend JAX runs on
    args = cli.build_parser().parse_args(["serve", "--port", free_port()])
    assert (args.max_batch, args.max_context) == (None, None)
    assert cli._serve_config(args).resolved() == ServeConfig().resolved(jax.default_backend())


@pytest.mark.parametrize("name", ["prefill_chunk", "step_tokens"])
def test_the_batch_engine_takes_the_same_prefill_chunks_and_budgets(name):
    """BatchEngine (a library entry point of its own) checks prefill_chunk and step_tokens against the
    same bounds."""
    knob = RANGES[name]
    for value in (knob.hi + knob.multiple, knob.lo - knob.multiple):
        with pytest.raises(ValueError, match=f"{name} must be an integer in {knob.lo}..{knob.hi}, "):
            BatchEngine(NoModel(), None, slots=1, max_new_tokens=8, block_size=1, **{name: value})
    with pytest.raises(ValueError, match=f"{name} must be a multiple of {knob.multiple}"):
        BatchEngine(NoModel(), None, slots=1, max_new_tokens=8, block_size=1, **{name: knob.lo + knob.multiple // 2})


def test_a_full_queue_is_queue_full_in_the_scheduler_and_a_429_through_the_app():
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    target, assistant = models.presets.tiny_pair(seed=0)
    tok = train_byte_bpe([DEMO_CORPUS], vocab_size=target.config.vocab_size)
    limit, slots = seeded_int(1, 5), seeded_int(1, 4)
    srv = Server(target, assistant, tok, ServeConfig(max_queue=limit, max_batch=slots), model_name="m")
    parked = [Job(ids=[3], max_tokens=2, stop=[], params=sampling.SamplingParams(), seed=0) for _ in range(limit)]
    told = []
    for job in parked:
        job.emit = told.append
    with srv.cond:  # queued without waking the worker (submit notifies it): they stay waiting
        srv.queue.extend(parked)

    async def submit():
        return srv.scheduler.submit(Job(ids=[3], max_tokens=2, stop=[], params=sampling.SamplingParams(), seed=0))
    with pytest.raises(QueueFull) as e:  # the scheduler's own error, no HTTP status in it
        asyncio.run(submit())
    assert not isinstance(e.value, ApiError)
    assert (e.value.waiting, e.value.limit, e.value.retry_after) == (limit, limit, 1 + limit // slots)

    guard = Guard(srv.app(), api_key=None, max_body_bytes=1 << 20, bound_host="127.0.0.1")
    with serving(guard) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="m", prompt="def", max_tokens=2)
        wait = e.value.response.headers["retry-after"]
        assert e.value.status_code == 429 and int(wait) >= 1
        err = e.value.body
        assert err["code"] == "queue_full" and err["type"] == "invalid_request_error", err
        assert err["message"] == f"{limit} requests are waiting (--max-queue {limit}): retry in {wait} s", err
        assert srv.waiting == limit  # refused before it queued
        assert [m.id for m in client.models.list().data] == ["m"]  # and the server serves on
    assert srv.scheduler._engine is None  # nothing was built
    srv.close()  # the parked jobs end with a 503 each
    assert [(type(ev).__name__, ev.status) for ev in told] == [("ErrorEvent", 503)] * limit
