"""Where the on-policy data's training texts come from (jaxspec.train.onpolicy_sources.training_texts),
on a made-up Python tree: the standard library's and site-packages' *.py give code and their
docstrings give docs; test and vendored directories and license files are never read; the
site-packages cap takes files evenly spaced over the sorted walk, not its first ones."""
import os
import sysconfig

import numpy as np
import pytest

from jaxspec.train import onpolicy_sources as S
from support.seeds import seeded_rng


def _words(rng, n):
    return " ".join("".join(rng.choice(list("abcdefghij"), int(rng.integers(3, 9)))) for _ in range(n))


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """(stdlib, purelib, {site-packages module rel path: its docstring}) with sysconfig pointed there."""
    rng = seeded_rng()
    stdlib, purelib = tmp_path / "lib", tmp_path / "site"

    def module(path, doc):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""{doc}"""\n\n' + "\n".join(f"x{i} = {i}  # {_words(rng, 6)}" for i in range(20)) + "\n")

    module(stdlib / "json" / "tool.py", _words(rng, 60))
    module(stdlib / "test" / "test_json.py", _words(rng, 60))  # a test directory: skipped
    docs = {}
    for i in range(12):
        rel = os.path.join(f"pkg{i:02d}", "core.py")
        docs[rel] = _words(rng, 60)
        module(purelib / rel, docs[rel])
    module(purelib / "pkg00" / "tests" / "test_core.py", _words(rng, 60))
    module(purelib / "pkg01" / "_vendor" / "six.py", _words(rng, 60))
    (purelib / "pkg02" / "LICENSE.txt").write_text(_words(rng, 120))
    paths = dict(sysconfig.get_paths(), stdlib=str(stdlib), purelib=str(purelib))
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: paths)
    return stdlib, purelib, docs


def test_site_packages_code_and_docstrings_are_read_and_capped_evenly(tree, monkeypatch):
    stdlib, purelib, docs = tree
    kinds, info = S.training_texts()
    code = [name for name, _ in kinds["code"]]
    assert code == ["stdlib/json/tool.py"] + [f"site-packages/{rel}" for rel in sorted(docs)]
    got_docs = {name: text for name, text in kinds["docs"]}
    for rel, doc in docs.items():
        assert got_docs[f"site-packages/{rel}#doc0"] == doc
    every = " ".join(name for k in kinds.values() for name, _ in k)
    for skipped in ("test_json", "test_core", "six.py", "LICENSE"):
        assert skipped not in every
    assert "12 site-packages *.py" in info["kind_sources"]["code"]

    monkeypatch.setattr(S, "SITE_PY_FILES", 4)  # 4 of the 12, evenly spaced: 0, 3, 6, 9
    kinds, info = S.training_texts()
    code = [name for name, _ in kinds["code"]][1:]
    assert code == [f"site-packages/{sorted(docs)[i]}" for i in np.arange(4) * 3]
    assert "4 site-packages *.py" in info["kind_sources"]["code"]
