"""The default pair's training text: Python source every training machine has offline.

    train, held, info = collect(source_roots(PACKAGES))

Sources: the standard library and the installed packages named in `PACKAGES` (missing ones are
skipped and recorded). Within each, every `*.py` found by `os.walk` with sorted directories,
skipping test and build directories (`SKIP_DIRS`) and files that are empty, larger than
`MAX_FILE_BYTES` (generated tables) or not UTF-8. A file is named `<source>/<path in source>`;
it is held out iff `int(sha1(name), 16) % HELDOUT_MOD == 0` (a rule on names, stable across
versions), and a file whose content already appeared earlier in (source, name) order is dropped as
a duplicate (vendored copies), so no held-out text is also trained on. `info` records the sources'
roots and versions, the rule, counts, bytes, the dropped files and a SHA-256 over the file names
and contents of each split.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sysconfig

# Installed on the training machine (the H200 image); each adds real, varied Python.
PACKAGES = ("numpy", "scipy", "jax", "flax", "optax", "chex", "equinox", "pandas", "sklearn", "sympy",
            "networkx", "matplotlib", "torch", "transformers", "tokenizers", "requests", "urllib3", "rich",
            "pygments", "jinja2", "click", "attr", "yaml", "tqdm", "packaging", "setuptools", "pip")
SKIP_DIRS = {"test", "tests", "testing", "idle_test", "site-packages", "dist-packages", "__pycache__", "_vendor",
             "build", "benchmarks"}
MAX_FILE_BYTES = 512 * 1024
HELDOUT_MOD = 20
_DISTRIBUTIONS = {"sklearn": "scikit-learn", "attr": "attrs", "yaml": "PyYAML"}  # import name -> distribution


def source_roots(packages=PACKAGES) -> dict[str, str | None]:
    """{"stdlib": its directory, package: its directory or None when not installed}, in order."""
    roots = {"stdlib": sysconfig.get_paths()["stdlib"]}
    for name in packages:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        roots[name] = locations[0] if locations else None
    return roots


def version(name: str) -> str | None:
    if name == "stdlib":
        return platform.python_version()
    try:
        return importlib.metadata.version(_DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return None


def is_heldout(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def _python_files(root: str) -> list[str]:
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        found += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files if f.endswith(".py")]
    return sorted(found)


def collect(roots: dict[str, str | None], max_files: int | None = None):
    """-> (train, held, info): train and held are [(name, text)] in (source, name) order.
    `max_files`: at most this many files per source (a quick run)."""
    train, held, seen = [], [], set()
    dropped = {"duplicate": [], "undecodable": [], "too_large": []}
    sources = {}
    digests = {"train": hashlib.sha256(), "held": hashlib.sha256()}
    for source, root in roots.items():
        if root is None or not os.path.isdir(root):
            sources[source] = dict(root=root, version=None, files=0, bytes=0, missing=True)
            continue
        n = size = 0
        for rel in _python_files(root)[:max_files]:
            name = f"{source}/{rel}"
            with open(os.path.join(root, rel), "rb") as f:
                raw = f.read()
            if len(raw) > MAX_FILE_BYTES:
                dropped["too_large"].append(name)
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                dropped["undecodable"].append(name)
                continue
            if not text.strip():
                continue
            h = hashlib.sha1(raw).digest()
            if h in seen:
                dropped["duplicate"].append(name)
                continue
            seen.add(h)
            split = "held" if is_heldout(name) else "train"
            (held if split == "held" else train).append((name, text))
            digests[split].update(name.encode() + b"\0" + h)
            n, size = n + 1, size + len(raw)
        sources[source] = dict(root=root, version=version(source), files=n, bytes=size, missing=False)
    if not train or not held:
        raise RuntimeError(f"corpus split is empty: {len(train)} train / {len(held)} held-out files")
    info = dict(
        sources=sources, python=platform.python_version(), max_files=max_files,
        rule=(f"*.py under each source (stdlib, then {', '.join(r for r in roots if r != 'stdlib')}), "
              f"os.walk with sorted dirs skipping {sorted(SKIP_DIRS)}; files empty, over {MAX_FILE_BYTES} bytes "
              f"or not UTF-8 skipped; named <source>/<path>; a repeat of earlier content dropped; held out iff "
              f"int(sha1(name).hexdigest(), 16) % {HELDOUT_MOD} == 0"),
        n_train_files=len(train), n_heldout_files=len(held),
        train_bytes=sum(len(t.encode()) for _, t in train), heldout_bytes=sum(len(t.encode()) for _, t in held),
        dropped={k: len(v) for k, v in dropped.items()}, dropped_files=dropped,
        train_sha256=digests["train"].hexdigest(), heldout_sha256=digests["held"].hexdigest(),
        heldout_files=[r for r, _ in held])
    return train, held, info
