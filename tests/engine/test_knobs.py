"""Each knob's bound at each entry point (issue 41), refused before anything is loaded or compiled:
the block size K (1..16, the kernels' row window, and within the context), rounds per chunk
(1..64), temperature (0 or >= 1e-3), top_k / top_p / seed, and what prompt_ids may be. The Python
API (generate, make_generate, Generator.inputs, stream_generate, BatchEngine, the server's
constructor and request parser) and the CLI's flags (one line, exit status 2). No model is built:
a stand-in target holds the config fields the checks read, and anything past the checks fails."""
import json
import time

import numpy as np
import pytest

import jaxspec
from jaxspec import cli
from jaxspec.engine import sampling, streaming
from jaxspec.engine.generate import MAX_BLOCK_SIZE, MAX_ROUNDS_PER_CHUNK, MAX_VERIFY_WIDTH
from jaxspec.engine.batching import BatchEngine
from jaxspec import models
from jaxspec.models import presets
from support.no_model import NoModel
from support.seeds import seeded_rng


def prompt(n=5):
    return seeded_rng().integers(3, 512, n).tolist()


def cli_refuses(capsys, monkeypatch, *argv) -> str:
    """Exit status 2 with one line on stderr, nothing on stdout, before any model is loaded."""
    monkeypatch.setattr(cli, "_load_pair", lambda *a, **k: pytest.fail("models loaded before the flag was refused"))
    t0 = time.perf_counter()
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (rc, out, err)
    assert err.startswith("jaxspec: error: ") and time.perf_counter() - t0 < 5
    return err.strip()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """config.json of a target whose context is 12 tokens (no weights, no tokenizer: the flags are
    checked before either is read)."""
    d = tmp_path_factory.mktemp("ctx12")
    (d / "config.json").write_text(json.dumps(presets.tiny_target_dict(max_position_embeddings=12)))
    return str(d)


# ---- block size ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, MAX_BLOCK_SIZE + 1, 1000])
def test_block_size_is_bounded_everywhere(k, capsys, monkeypatch):
    want = rf"block_size must be an integer in 1\.\.{MAX_BLOCK_SIZE} .*got {k}"
    with pytest.raises(ValueError, match=want):
        jaxspec.make_generate(block_size=k)
    with pytest.raises(ValueError, match=want):
        jaxspec.generate(NoModel(), prompt(), block_size=k)
    with pytest.raises(ValueError, match=want):
        streaming.stream_generate(NoModel(), prompt(), block_size=k)
    with pytest.raises(ValueError, match=want):
        BatchEngine(NoModel(), None, slots=1, max_new_tokens=8, block_size=k)
    server = pytest.importorskip("jaxspec.serve.app")
    with pytest.raises(ValueError, match=want):
        server.Server(NoModel(), None, None, model_name="m", block_size=k)
    for command in (["generate", "hi"], ["serve"]):
        err = cli_refuses(capsys, monkeypatch, *command, "--block-size", str(k))
        assert err == (f"jaxspec: error: --block-size {k}: expected an integer in 1..{MAX_BLOCK_SIZE} "
                       f"(K: at most the kernels' {MAX_BLOCK_SIZE}-row window)")


def test_block_size_within_the_context(capsys, monkeypatch, model_dir):
    assert MAX_BLOCK_SIZE == models.ROW_TILE  # the kernels' row window
    with pytest.raises(ValueError, match="block_size=16 is wider than the model's context of 12 tokens"):
        jaxspec.generate(NoModel(context=12), prompt(2), block_size=16, max_new_tokens=2)
    with pytest.raises(ValueError, match="block_size=13 is wider than the model's context of 12 tokens"):
        BatchEngine(NoModel(context=12), None, slots=1, max_new_tokens=2, block_size=13)
    err = cli_refuses(capsys, monkeypatch, "generate", "hi", "--model", model_dir, "--block-size", "13")
    assert err.endswith("--block-size: block_size=13 is wider than the model's context of 12 tokens")


def test_verify_pad_width_is_bounded():
    for bad in (-1, MAX_VERIFY_WIDTH + 1):
        with pytest.raises(ValueError, match=rf"verify_pad must be an integer in 0\.\.{MAX_VERIFY_WIDTH}"):
            jaxspec.generate(NoModel(), prompt(), verify_pad=bad)
        with pytest.raises(ValueError, match="verify_pad"):
            jaxspec.make_generate(verify_pad=bad)


# ---- rounds per chunk ----------------------------------------------------------------------------
@pytest.mark.parametrize("r", [0, MAX_ROUNDS_PER_CHUNK + 1, 1_000_000])
def test_rounds_per_chunk_is_bounded_everywhere(r, capsys, monkeypatch):
    want = rf"must be an integer in 1\.\.{MAX_ROUNDS_PER_CHUNK}, got {r}"
    with pytest.raises(ValueError, match="rounds_per_chunk " + want):
        streaming.stream_generate(NoModel(), prompt(), rounds_per_chunk=r)
    with pytest.raises(ValueError, match="rounds_per_step " + want):
        BatchEngine(NoModel(), None, slots=1, max_new_tokens=8, block_size=1, rounds_per_step=r)
    server = pytest.importorskip("jaxspec.serve.app")
    with pytest.raises(ValueError, match="rounds_per_chunk " + want):
        server.Server(NoModel(), None, None, model_name="m", rounds_per_chunk=r)
    rng = f"expected an integer in 1..{MAX_ROUNDS_PER_CHUNK}"
    assert cli_refuses(capsys, monkeypatch, "generate", "hi", "--stream", "--stream-rounds", str(r)).endswith(
        f"--stream-rounds {r}: {rng}")
    assert cli_refuses(capsys, monkeypatch, "serve", "--rounds-per-chunk", str(r)).endswith(
        f"--rounds-per-chunk {r}: {rng}")


# ---- sampling values -------------------------------------------------------------------------------
BAD_SAMPLING = [  # (generate's keyword, value, the CLI flag, the server's field)
    ("temperature", 1e-45, "--temperature", "temperature"),
    ("temperature", sampling.MIN_TEMPERATURE / 2, "--temperature", "temperature"),
    ("top_k", 0, "--top-k", "top_k"),
    ("top_k", 2**31, "--top-k", "top_k"),
    ("top_p", 0.0, "--top-p", "top_p"),
    ("top_p", 1.5, "--top-p", "top_p"),
    ("seed", -1, "--seed", "seed"),
    ("seed", 2**64, "--seed", "seed"),
    ("presence_penalty", 2.5, "--presence-penalty", "presence_penalty"),
    ("frequency_penalty", -3, "--frequency-penalty", "frequency_penalty"),
    ("repetition_penalty", 0.0, "--repetition-penalty", "repetition_penalty"),
    ("repetition_penalty", 1000, "--repetition-penalty", "repetition_penalty"),
]


@pytest.mark.parametrize("name,value,flag,field", BAD_SAMPLING, ids=[f"{b[0]}={b[1]}" for b in BAD_SAMPLING])
def test_sampling_values_are_refused_at_every_entry_point(name, value, flag, field, capsys, monkeypatch):
    kw = {name: value} if name in ("temperature", "seed") else {"temperature": 1.0, name: value}
    with pytest.raises(ValueError, match=name):
        jaxspec.generate(NoModel(), prompt(), **kw)
    extra = [] if name in ("temperature", "seed") else ["--temperature", "1"]
    err = cli_refuses(capsys, monkeypatch, "generate", "hi", *extra, flag, str(value))
    assert name in err or flag in err
    server = pytest.importorskip("jaxspec.serve.app")
    srv = server.Server(NoModel(), None, None, model_name="m")
    srv.compiles.__exit__()  # its compile log would otherwise record the rest of this process
    body = {"prompt": "x", **({} if name in ("temperature", "seed") else {"temperature": 1.0}), field: value}
    with pytest.raises(server.ApiError) as e:
        srv.job(json.dumps(body).encode(), chat=False)
    assert e.value.status == 400 and e.value.param == field and f"'{field}'" in e.value.message


@pytest.mark.parametrize("n", [0, 17])
def test_n_is_refused_by_the_cli_and_the_server(n, capsys, monkeypatch):
    assert "--n" in cli_refuses(capsys, monkeypatch, "generate", "hi", "--n", str(n))
    server = pytest.importorskip("jaxspec.serve.app")
    srv = server.Server(NoModel(), None, None, model_name="m")
    srv.compiles.__exit__()
    with pytest.raises(server.ApiError) as e:
        srv.job(json.dumps({"prompt": [3, 4], "n": n}).encode(), chat=False)
    assert e.value.status == 400 and e.value.param == "n" and "'n' must be an integer in [1, 16]" in e.value.message


def test_a_request_of_n_choices_is_n_jobs_seeded_seed_plus_i():
    """Choice i is the request with seed + i (past 2**64 - 1 it wraps to 0: the seeds' range), every
    other field the same; without a seed, one random seed for the request, + i per choice."""
    server = pytest.importorskip("jaxspec.serve.app")
    srv = server.Server(NoModel(), None, None, model_name="m")
    srv.compiles.__exit__()
    body = {"prompt": [3, 4], "n": 3, "seed": 2**64 - 2, "temperature": 0.5, "presence_penalty": 0.5,
            "repetition_penalty": 1.2}
    jobs, stream = srv.jobs(json.dumps(body).encode(), chat=False)
    assert [j.seed for j in jobs] == [j.params.seed for j in jobs] == [2**64 - 2, 2**64 - 1, 0] and not stream
    assert {(j.params.presence_penalty, j.params.repetition_penalty, j.params.temperature) for j in jobs} == {
        (0.5, 1.2, 0.5)}
    assert len({id(j.cancelled) for j in jobs}) == 3  # each choice is cancelled on its own
    jobs, _ = srv.jobs(json.dumps({"prompt": [3, 4], "n": 2, "temperature": 0.5}).encode(), chat=False)
    assert jobs[1].seed == jobs[0].seed + 1


# ---- prompt ids -------------------------------------------------------------------------------------
NOT_TOKEN_IDS = [
    ({5: 1, 6: 1}, "got dict"),
    (None, "got NoneType"),
    ({5, 6}, "got set"),
    ((t for t in (5, 6)), "got generator"),
    ([[5, 6], {7: 1}], "prompt row 1 is not a sequence of ints"),
    (np.ones((1, 2, 3), np.int32), "1-D or 2-D"),
    (np.asarray([5.0, 6.0]), "non-integer"),
]


@pytest.mark.parametrize("ids,match", NOT_TOKEN_IDS, ids=[m for _, m in NOT_TOKEN_IDS])
def test_prompt_ids_must_be_token_id_sequences(ids, match):
    with pytest.raises(ValueError, match=match):
        jaxspec.generate(NoModel(), ids)
    with pytest.raises(ValueError, match=match):
        jaxspec.make_generate(block_size=1, max_new_tokens=8).inputs(ids)


def test_a_missing_target_is_a_value_error():
    with pytest.raises(ValueError, match="target must be a models.Target, got NoneType"):
        jaxspec.generate(None, prompt())
    with pytest.raises(ValueError, match="target must be a models.Target, got NoneType"):
        streaming.stream_generate(None, prompt())


# ---- min_p (issue 55): one range, every entry point ---------------------------------------------------
@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_min_p_is_refused_at_every_entry_point(value, capsys, monkeypatch):
    with pytest.raises(ValueError, match=r"min_p must be None or a number in \[0.0, 1.0\]"):
        jaxspec.generate(NoModel(), prompt(), temperature=1.0, min_p=value)
    with pytest.raises(ValueError, match="min_p"):
        BatchEngine(NoModel(), None, slots=1, max_new_tokens=8, block_size=1, temperature=1.0, min_p=value)
    assert "min_p" in cli_refuses(capsys, monkeypatch, "generate", "hi", "--temperature", "1", "--min-p", str(value))
    server = pytest.importorskip("jaxspec.serve.app")
    srv = server.Server(NoModel(), None, None, model_name="m")
    srv.compiles.__exit__()
    with pytest.raises(server.ApiError) as e:
        srv.job(json.dumps({"prompt": [3, 4], "temperature": 1.0, "min_p": value}).encode(), chat=False)
    assert e.value.status == 400 and e.value.param == "min_p" and "'min_p'" in e.value.message
    job, _ = srv.job(json.dumps({"prompt": [3, 4], "temperature": 1.0, "min_p": 0.25}).encode(), chat=False)
    assert job.params.min_p == 0.25 and job.params.mode().filter
