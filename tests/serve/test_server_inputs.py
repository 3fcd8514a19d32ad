"""`jaxspec serve`'s schema against hostile values, through the official `openai` client over real
HTTP (issue 65): an integer of 309+ digits in any numeric field (it overflowed the float conversion:
a 500 with a traceback, no key needed) and a `stop` of the wrong type (silently dropped) are 400s
naming the field; a refusal echoes the value as it was sent, cut visibly when long. In process: the
server's app (the tiny pair, never warmed: every refusal comes before any compute, so nothing is
built) behind its guard, in a uvicorn thread."""
import json

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from jaxspec import models  # noqa: E402
from jaxspec.serve.guard import SHOWN_CHARS, Guard  # noqa: E402
from jaxspec.serve.app import Server  # noqa: E402
from jaxspec.text.tokenizer import DEMO_CORPUS, Tokenizer, train_byte_bpe  # noqa: E402
from support.seeds import seeded_int  # noqa: E402
from support.serve_inproc import serving  # noqa: E402


@pytest.fixture(scope="module")
def served():
    target, assistant = models.presets.tiny_pair(seed=0)
    tok = Tokenizer(train_byte_bpe([DEMO_CORPUS], vocab_size=target.config.vocab_size),
                    chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    srv = Server(target, assistant, tok, model_name="m", max_batch=2)
    guard = Guard(srv.app(), api_key=None, max_body_bytes=1 << 20, bound_host="127.0.0.1")
    with serving(guard) as url:
        yield srv, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    srv.close()


def refusal(call) -> dict:
    """The 400 a call gets (the openai client raises it), as OpenAI's error object."""
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body


HUGE = 10 ** 309 - 1 - seeded_int(1 << 30)  # 309 digits: past a float's range (1.8e308)
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "n", "best_of",
          "presence_penalty", "frequency_penalty"]
CHAT_FIELDS = ["max_completion_tokens", "top_logprobs"]


def test_huge_integers_are_400s_naming_the_field(served):
    srv, client = served
    for name in FIELDS:
        for v in (HUGE, -HUGE):
            err = refusal(lambda: client.completions.create(model="m", prompt="x", extra_body={name: v}))
            assert err["param"] == name and f"'{name}'" in err["message"], err
    for name in CHAT_FIELDS:
        err = refusal(lambda: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], logprobs=True, extra_body={name: HUGE}))
        assert err["param"] == name, err
    err = refusal(lambda: client.completions.create(model="m", prompt="x", logit_bias={"5": HUGE}))
    assert err["param"] == "logit_bias" and "[-100, 100]" in err["message"], err
    err = refusal(lambda: client.completions.create(model="m", prompt=[5, HUGE]))
    assert err["param"] == "prompt", err
    assert srv.scheduler._engine is None  # refused before anything was built


def test_a_stop_of_the_wrong_type_is_a_400(served):
    _, client = served
    for stop in (123, True, {}, 1.5, {"a": 1}, [1], ["ok", None]):
        err = refusal(lambda: client.completions.create(model="m", prompt="x", max_tokens=2, stop=stop))
        assert err["param"] == "stop" and f"got {json.dumps(stop)}" in err["message"], err


def test_a_refusal_echoes_the_value_as_sent(served):
    """`"seed": "1"` (a string) read "got 1", as if it were the number; a long value is cut with a
    marker saying how long it was."""
    _, client = served
    err = refusal(lambda: client.completions.create(model="m", prompt="x", extra_body={"seed": "1"}))
    assert err["message"].endswith('got "1"'), err
    err = refusal(lambda: client.completions.create(model="m", prompt="x", temperature=HUGE))
    text = str(HUGE)
    assert err["message"].endswith(f"got {text[:SHOWN_CHARS]}... ({len(text)} characters)"), err
    err = refusal(lambda: client.completions.create(model="m", prompt="x", logit_bias={"1e3": 1}))
    assert err["message"].endswith('got "1e3"'), err
