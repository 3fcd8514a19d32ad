"""Chat templates render within limits (issue 41): a template comes with the model's files, and one
with nested 100,000-step loops hung generation. Now a step limit, an output-size limit, a size limit
on +, * and ** and a wall-clock limit end it with a TokenizerError naming the limit, while a real
chat template renders exactly as Jinja's plain sandbox renders it."""
import sys
import threading
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxspec.text import chat_template
from jaxspec.text.chat_template import TokenizerError, render_chat_template
from support.seeds import seeded_rng

# A Gemma-style chat template, written for this test: an optional system turn folded into the first
# user turn, alternating roles checked, "assistant" renamed "model", text parts of list contents.
GEMMA_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set first_prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('roles must alternate user/assistant') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_prefix if loop.first else '') }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for part in message['content'] if part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""


def conversation(turns: int):
    rng = seeded_rng()
    words = ["".join(rng.choice(list("abcdefghij \n"), int(rng.integers(1, 12)))) for _ in range(400)]
    text = lambda: " ".join(rng.choice(words, int(rng.integers(3, 60))))  # noqa: E731
    msgs = [{"role": "system", "content": text()}]
    for i in range(turns):
        content = text() if i % 3 else [{"type": "text", "text": text()}, {"type": "image"}]
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return msgs


def plain_render(template, messages, **variables):
    """The reference: Jinja's sandbox without jaxspec's limits."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **variables)


def test_a_real_template_renders_unchanged():
    before = sys.gettrace()
    msgs = conversation(301)
    want = plain_render(GEMMA_STYLE, msgs, bos_token="<bos>")
    t0 = time.perf_counter()
    got = render_chat_template(GEMMA_STYLE, msgs, bos_token="<bos>")
    assert got == want and got.count("<start_of_turn>model\n") == 151
    assert time.perf_counter() - t0 < 2.0  # 300 turns: milliseconds (the limits cost ~2x on this)
    assert sys.gettrace() is before  # the tracer in place before (a debugger, coverage) is back


def rendered_in_time(template, seconds=30.0):
    """render_chat_template(template) in a thread: (finished in time, its exception or None). A
    template that hangs leaves the thread behind instead of hanging the test."""
    out = {}

    def run():
        try:
            render_chat_template(template, [])
        except Exception as e:
            out["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), out.get("error")


@pytest.mark.parametrize("template,limit", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "TEMPLATE_MAX_STEPS"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "TEMPLATE_MAX_CHARS"),
    ("{{ 'x' * 10 ** 10 }}", "TEMPLATE_MAX_CHARS"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "TEMPLATE_MAX_CHARS"),
    ("{{ 7 ** 100000 }}", "65,536-bit"),
], ids=["nested loops", "output", "repeat", "doubling", "power"])
def test_runaway_templates_end_with_the_limit_named(template, limit):
    finished, error = rendered_in_time(template)
    assert finished, "the template is still running"
    assert isinstance(error, TokenizerError) and limit in str(error), error


def test_wall_clock_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "TEMPLATE_MAX_SECONDS", 0.3)
    t0 = time.perf_counter()
    finished, error = rendered_in_time("{% for i in range(100000) %}{{ range(20000) | sum }}{% endfor %}")
    assert finished and isinstance(error, TokenizerError) and "TEMPLATE_MAX_SECONDS" in str(error), error
    assert time.perf_counter() - t0 < 3.0


# ---- issue 51: recursion is the template's error; sizes are checked before the string is built ------
def test_a_recursive_macro_is_a_template_error_naming_it(capsys):
    template = "{% macro spiral(n) %}{{ spiral(n + 1) }}{% endmacro %}{{ spiral(0) }}"
    finished, error = rendered_in_time(template)
    assert finished and isinstance(error, TokenizerError), repr(error)
    assert "macro 'spiral' recurses past Python's limit" in str(error), error
    from jaxspec import cli
    assert cli._guarded(lambda _: render_chat_template(template, []), None, False) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "error: chat template error: macro 'spiral'" in err and "internal error" not in err, err
    finished, error = rendered_in_time("{{ 'x' | center(1.5) }}")  # Python's TypeError: the template's error too
    assert finished and isinstance(error, TokenizerError) and "TypeError" in str(error), repr(error)


@pytest.mark.parametrize("expr", [
    "'x' | center(400000000)", "'x' | center(4e8)", "'x'.center(400000000)", "'x'.ljust(400000000)",
    "'x'.zfill(400000000)", "'a\\tb'.expandtabs(300000000)", "'x' | indent(400000000, true)",
    "'%400000000s' | format('x')", "'%400000000s' % 'x'", "'%*s' % (400000000, 'x')", "'%.400000000f' % 1.5",
    "'{:>400000000}'.format('x')", "'{:0>400000000}'.format('x')", "'{:{}}'.format('x', 400000000)",
    "(['x' * 10000000] * 10) | join", "(['a', 'b'] * 50000) | join('x' * 1000)", "'.'.join(['y' * 9000000] * 10)",
    "('a' * 100000) | replace('a', 'b' * 1000)", "('a' * 100000).replace('a', 'b' * 1000)",
    "a ~ a ~ a ~ a ~ a ~ a ~ a ~ a ~ a ~ a",
], ids=lambda e: e[:40])
def test_a_size_past_the_limit_is_refused_before_it_is_built(expr):
    """Each builds ~90 Mi to 400 Mi characters: refused by the size it asks for (TEMPLATE_MAX_CHARS),
    not after the string exists (the output check alone ran only after 1.76 GB were allocated)."""
    import tracemalloc
    tracemalloc.start()
    try:
        finished, error = rendered_in_time("{% set a = 'x' * 9000000 %}{{ " + expr + " }}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert finished and isinstance(error, TokenizerError) and "TEMPLATE_MAX_CHARS" in str(error), repr(error)
    assert peak < 80 << 20, f"{peak:,} bytes allocated before the refusal"


def test_sizes_within_the_limit_render_as_jinja_renders_them():
    rng = seeded_rng()
    w = int(rng.integers(20, 60))
    template = ("{{ 'ab' | center(W) }}|{{ 'ab'.ljust(W) }}|{{ '%-Ws|%.3f' % ('c', 1.25) }}|{{ '{:>W}'.format('d') }}|"
                "{{ ['e', 'f'] | join('-') }}|{{ 'g\\th' | indent(3, true) }}|{{ 'ii' | replace('i', 'jk') }}|"
                "{{ 'l' ~ 2 ~ 'm' }}|{{ '%*d' % (W, 7) }}|{{ '{:{}}'.format('n', W) }}").replace("W", str(w))
    assert render_chat_template(template, []) == plain_render(template, [])
