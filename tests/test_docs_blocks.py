"""Every code block of README.md and docs/*.md runs as written or says why not (issue 50).

The convention (docs/README's readers copy these blocks):
- a fenced block names its language: ```python, ```bash, ```text (signatures, output, layouts), ...;
- the ```python blocks of one page run in order in one namespace, as a reader pasting them into one
  session would: the page's first block sets up what later ones use (on the embedded default pair);
- a block preceded by `<!-- not runnable: REASON -->` is not run (a GPU, a big checkpoint, a running
  server, your own arrays...), and `<!-- needs: MODULE[, MODULE] (REASON) -->` runs only where those
  modules import (an extra's package); both are skipped here with their reason, which pytest lists
  (`-rs`);
- ```bash blocks are commands for a shell (make demo, jaxspec ...): checked for form here, not run.

This test runs every runnable python block on CPU. The pages load the default pair several times
(each example stands alone): one load is shared (`load_default_pair` is memoised for this module),
and the examples keep to one prompt bucket and budget so their programs compile once.
"""
import ast
import contextlib
import functools
import glob
import importlib.util
import io
import os
import re

import pytest

from support.paths import REPO  # noqa: E402
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!--\s*(not runnable|needs):\s*(.*?)\s*-->\s*\Z", re.S)
LANGUAGES = {"python", "bash", "text", "json", "jinja"}


def blocks(page: str) -> list[dict]:
    """The fenced blocks of a page: language, source, first line, and its marker (kind, reason)."""
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip().rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        out.append(dict(page=page, lang=m.group(1).strip(), src=m.group(2),
                        line=text.count("\n", 0, m.start()) + 2,  # the block's first line of code
                        mark=(mark.group(1), mark.group(2)) if mark else None))
    return out


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b["lang"] == "python"]


@pytest.mark.parametrize("block", ALL, ids=[f"{b['page']}:{b['line']}" for b in ALL])
def test_every_block_declares_what_it_is(block):
    """A language on every fence, a known one; a runnable python block is valid Python; a marker
    gives its reason."""
    assert block["lang"] in LANGUAGES, f"{block['page']}:{block['line']}: fence language {block['lang']!r} " \
                                       f"(use one of {sorted(LANGUAGES)}; ```text for signatures and output)"
    if block["mark"] is not None:
        assert block["mark"][1], f"{block['page']}:{block['line']}: a marker without its reason"
    if block["lang"] == "python" and block["mark"] is None:
        ast.parse(block["src"], f"{block['page']}:{block['line']}")


@functools.lru_cache(maxsize=None)
def _shared_pair(dtype=None, matmul=None, path=None):
    from jaxspec import default_pair

    return _REAL_LOAD(dtype, matmul=matmul, path=path)


_REAL_LOAD = None
NAMESPACES: dict[str, dict] = {}  # page -> the namespace its blocks share
RAN: dict[str, int] = {}


@pytest.fixture(scope="module")
def one_pair_load():
    """`load_default_pair` loads once for every page (the blocks import it by name at run time)."""
    global _REAL_LOAD
    from jaxspec import default_pair

    _REAL_LOAD = default_pair.load_default_pair
    default_pair.load_default_pair = lambda dtype=None, *, matmul=None, path=None: _shared_pair(dtype, matmul, path)
    yield
    default_pair.load_default_pair = _REAL_LOAD


@pytest.mark.parametrize("block", PYTHON, ids=[f"{b['page']}:{b['line']}" for b in PYTHON])
def test_python_block_runs(block, one_pair_load, capsys):
    where = f"{block['page']}:{block['line']}"
    if block["mark"] is not None:
        kind, reason = block["mark"]
        if kind == "not runnable":
            pytest.skip(f"{where}: not runnable: {reason}")
        missing = [m for m in re.split(r"[,\s]+", reason.split("(")[0].strip()) if m
                   and importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"{where}: needs {', '.join(missing)} ({reason})")
    ns = NAMESPACES.setdefault(block["page"], {"__name__": "__main__"})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block["src"], where, "exec"), ns)  # noqa: S102 - the documentation's own code
    RAN[block["page"]] = RAN.get(block["page"], 0) + 1


def test_the_readme_example_ran():
    """Runs last in this file: the README's python example(s) ran (not all skipped)."""
    assert RAN.get("README.md", 0) >= 1, f"no README.md python block ran (ran: {RAN})"
