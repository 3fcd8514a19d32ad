"""jaxspec.train.quality: the plausibility procedure on hand-written completions (each rule
of the cut and of the parse), its prompts from real source, and one scored run of the shipped pair."""
import textwrap

import pytest

from jaxspec.default_pair import default_pair_available
from jaxspec.train import quality

HEADER = "def area(width, height):"


@pytest.mark.parametrize("completion,expected", [
    ("\n    return width * height\n", True),
    ("  # a comment after the colon\n    return width\n", True),
    ("\n\n    return width * height\n", True),
    ("\n    return width * height", False),                   # the body's line never ended
    ('\n    """The area."""\n    w = width\n    return w * height\n\nprint(area(2, 3))\n', True),  # cut at the def's end
    ("\n    w = width\n    total = sum(\n        [w,\n", True),  # an unfinished last statement is cut off
    ("\n    w = 2\n    if width:\n        return (width +\n", True),
    ("\n    total = sum(\n        [width,\n", False),        # nothing complete before it
    ("\n    return width * height\n    x = = 2\n", False),   # invalid, not unfinished
    ("\n    return width ** ** height\n", False),
    ("\n    )\n", False),
    ("", False),
    (" return width\n", False),                            # code after the colon: not a header's line
    ("\n    return width * hei", False),                   # no whole line of body
    ("\n\nclass Shape:\n    pass\n", False),               # the function ended with an empty body
    ("\nreturn width\n", False),                           # not indented: no body at all
])
def test_plausible_follows_the_procedure(completion, expected):
    assert quality.plausible(HEADER, completion) is expected


def test_cut_keeps_whole_lines_of_the_function():
    text = "    a = 1\n\n    b = 2\nc = 3\n    d = 4\n"
    assert quality.cut(text) == "    a = 1\n\n    b = 2\n"
    assert quality.cut("    a = 1\n    b = (") == "    a = 1\n"


def test_signature_prompts_and_pick():
    src = textwrap.dedent('''\
        import os

        @decorator
        def alpha(x,
                  y=2):
            """Doc."""
            return x


        class K:
            async def beta(self):
                pass

            def one_line(self): return 1

            def gamma(self):  # a comment
                # another
                return 3
        ''')
    prompts = quality.signature_prompts([("b.py", "def z():\n    pass\n"), ("a.py", src), ("bad.py", "def (:\n")])
    assert [(p["file"], p["line"], p["text"]) for p in prompts] == [
        ("a.py", 4, "def alpha(x,\n          y=2):"),
        ("a.py", 11, "async def beta(self):"),
        ("a.py", 16, "def gamma(self):  # a comment"),  # the comment line after it dropped
        ("b.py", 1, "def z():"),
    ]
    assert quality.pick(list(range(10)), 3) == [0, 3, 6]
    assert quality.pick([1, 2], 5) == [1, 2]


@pytest.mark.skipif(not default_pair_available(), reason="the default pair is not installed")
def test_fitting_leaves_room_for_the_completion():
    """A prompt is kept iff its tokens plus max_tokens fit the context (the tokenizer decides)."""
    class Words:  # one token per whitespace-separated word
        def encode(self, text):
            return type("Encoding", (), {"ids": text.split()})()

    prompts = [dict(text="def f(a):"), dict(text="def g(a, b, c):"), dict(text="def h(a, b, c, d, e):")]
    assert [p["text"] for p in quality.fitting(prompts, Words(), 10, 6)] == ["def f(a):", "def g(a, b, c):"]
    assert quality.fitting(prompts, Words(), 10, 7) == [prompts[0]]
    assert quality.fitting(prompts, Words(), 10, 9) == []


def test_the_shipped_pair_scores():
    from jaxspec.default_pair import load_default_pair
    from jaxspec.kernels import DispatchConfig

    target, _, tok = load_default_pair(matmul=DispatchConfig(backend="xla"))
    prompts = [dict(file="x.py", line=1, text="def add(a, b):"), dict(file="x.py", line=5, text="def main():")]
    r = quality.score(target, tok, prompts, max_tokens=12)
    assert r["n"] == 2 and 0.0 <= r["plausibility"] <= 1.0
    for row in r["rows"]:
        assert row["plausible"] == quality.plausible(row["prompt"], row["completion"]) and row["completion"]
    assert r["plausibility"] == sum(row["plausible"] for row in r["rows"]) / 2
    files = quality.heldout_files()  # the pair's held-out stdlib files, read on this machine
    assert files and all(name in dp_heldout() for name, _ in files)


def dp_heldout():
    from jaxspec.default_pair import default_pair_metrics
    return set(default_pair_metrics()["corpus"]["heldout_files"])
