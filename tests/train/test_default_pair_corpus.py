"""jaxspec.train.corpus on a small tree: which files count, the held-out rule on names,
duplicates dropped across sources, what info records, and the installed packages found."""
import itertools

from jaxspec.train import corpus


def _write(root, rel, data):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data if isinstance(data, bytes) else data.encode())


def test_collect_follows_the_rule(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    held_name = next(f"h{i}.py" for i in itertools.count() if corpus.is_heldout(f"a/h{i}.py"))
    train_name = next(f"t{i}.py" for i in itertools.count() if not corpus.is_heldout(f"a/t{i}.py"))
    _write(a, held_name, "x = 1\n")
    _write(a, train_name, "def f():\n    return 2\n")
    _write(a, "sub/" + train_name, "y = 3\n")
    _write(a, "tests/test_x.py", "assert True\n")          # a test directory: skipped
    _write(a, "big.py", "z = 0\n" * (corpus.MAX_FILE_BYTES // 6 + 1))
    _write(a, "latin.py", b"s = '\xe9'\n")                  # not UTF-8
    _write(a, "empty.py", "\n\n")
    _write(a, "notes.txt", "not python\n")
    _write(b, "copy.py", "def f():\n    return 2\n")       # a's file again: dropped
    _write(b, "own.py", "w = 4\n")
    roots = {"a": str(a), "b": str(b), "gone": None}
    train, held, info = corpus.collect(roots)
    names = [n for n, _ in train] + [n for n, _ in held]
    assert sorted(names) == sorted([f"a/{held_name}", f"a/{train_name}", f"a/sub/{train_name}", "b/own.py"])
    assert all(corpus.is_heldout(n) for n, _ in held) and not any(corpus.is_heldout(n) for n, _ in train)
    assert f"a/{held_name}" in dict(held)
    assert info["dropped_files"] == {"duplicate": ["b/copy.py"], "undecodable": ["a/latin.py"], "too_large": ["a/big.py"]}
    assert info["sources"]["gone"]["missing"] and info["sources"]["a"]["files"] == 3
    assert info["n_train_files"] + info["n_heldout_files"] == 4 and info["heldout_files"] == [n for n, _ in held]
    again = corpus.collect(roots)[2]
    assert (again["train_sha256"], again["heldout_sha256"]) == (info["train_sha256"], info["heldout_sha256"])
    _write(b, "own.py", "w = 5\n")  # a content change shows in the hash of its split
    changed = corpus.collect(roots)[2]
    assert (changed["train_sha256"] != info["train_sha256"]) != (changed["heldout_sha256"] != info["heldout_sha256"])


def test_source_roots_finds_installed_packages():
    roots = corpus.source_roots(("json", "numpy", "no_such_package_xyz"))
    assert list(roots) == ["stdlib", "json", "numpy", "no_such_package_xyz"]
    assert roots["numpy"].endswith("numpy") and roots["no_such_package_xyz"] is None
    assert corpus.version("numpy") and corpus.version("stdlib") and corpus.version("no_such_package_xyz") is None


def test_quality_reads_a_collected_pairs_heldout_files(tmp_path, monkeypatch):
    """quality.heldout_files follows collect()'s names (<source>/<path>) to each source's root."""
    from jaxspec.train import quality

    src = tmp_path / "src"
    names = [f"m{i}.py" for i in range(200)]
    for n in names:
        _write(src, n, f"def f{n[1:-3]}(x):\n    return x\n")
    _, held, info = corpus.collect({"pkg": str(src)})
    monkeypatch.setattr("jaxspec.default_pair.default_pair_metrics", lambda path=None: {"corpus": info})
    assert quality.heldout_files() == held
