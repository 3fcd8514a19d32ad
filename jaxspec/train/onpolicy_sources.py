"""Where the on-policy drafter data's prompts come from: text of several kinds that every training
machine has offline (the Python that runs jaxspec), and a held-out set from sources training never reads.

Training kinds (`training_texts`), all under the running Python's own directories:
    code      the standard library's `*.py` and up to SITE_PY_FILES of site-packages' (test and vendored
              directories skipped);
    docs      the docstrings of those files, and `*.rst` / `*.md` files in site-packages;
    prose     the installed distributions' METADATA long descriptions (their READMEs);
    lists     bullet and numbered blocks (>= 4 consecutive items) cut out of those docs and READMEs;
    dialogue  short written openers (`DIALOGUE_OPENERS`) that the target continues itself, by sampling:
              conversation is what this machine's text lacks.
License files are never read for training: legal text is a held-out kind.

Held-out kinds (`heldout_texts`, read on the machine that writes the held-out file, committed as
`jaxspec/data/drafters/<target>/heldout_onpolicy.json`): /usr/share/common-licenses (legal prose),
/usr/share/man/man1 (manual pages, troff stripped), /usr/share/doc changelogs (lists of changes),
and the 8 written prompts of the older held-out file (stories, letters, recipes). No training kind
reads /usr/share, and any training text containing a 40-character piece of a held-out prompt is
dropped as well (`assistant_data.drop_heldout`).
"""
from __future__ import annotations

import gzip
import importlib.metadata
import itertools
import os
import re
import sysconfig

from jaxspec.train.assistant_data import _docstrings

TRAIN_KINDS = ("code", "docs", "prose", "lists", "dialogue")
MAX_FILE_BYTES = 256 * 1024
# site-packages' *.py files read, evenly spaced over the sorted walk (the H100's had ~14k, the
# libraries jaxspec runs on): their code and docstrings widen what the drafter sees (the first data,
# stdlib code only and 170 READMEs of prose, taught it 0.84 / 0.50 first-position agreement on
# training / held-out rows); the cap bounds the read and the held-out scan (drop_heldout)
SITE_PY_FILES = 3000
SKIP_DIRS = {"test", "tests", "testing", "idle_test", "__pycache__", "_vendor", "vendor", "build", "site-packages",
             "dist-packages"}
_LICENSE = re.compile(r"(^|/)(LICEN[CS]E|COPYING|NOTICE|AUTHORS)", re.I)
_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+\S")

# Openers the target continues by sampling (kind "dialogue"): the start of a conversation, and
# nothing more, so the text is the target's own.
DIALOGUE_OPENERS = (
    '"Are you coming with us tomorrow?" asked Maria.\n"',
    "Customer: Hi, I ordered a lamp last week and it still hasn't arrived.\nAgent:",
    "Interviewer: Thank you for joining us today. How did you get started?\n",
    '"I don\'t think that\'s a good idea," said Tom.\n',
    "Q: What is the best way to learn a new language?\nA:",
    "Teacher: Who can tell me what photosynthesis is?\nStudent:",
    "User: Can you help me plan a trip to the mountains?\nAssistant:",
    '"Where did you put the keys?" she called from the kitchen.\n',
    "Doctor: What brings you in today?\nPatient:",
    "Alice: Did you see the game last night?\nBob:",
    "Reporter: What happened here this morning?\nWitness:",
    '"We have to leave before dark," the old man said.\n',
)


def _read(path: str) -> str | None:
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            return None
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError, EOFError):
        return None


def _walk(root: str, suffixes: tuple[str, ...], skip_dirs=SKIP_DIRS):
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip_dirs and not x.startswith("."))
        for fn in sorted(files):
            if fn.endswith(suffixes):
                yield os.path.join(d, fn)


def list_blocks(text: str, min_items: int = 4) -> list[str]:
    """Runs of >= min_items consecutive bullet / numbered lines (continuation lines kept)."""
    out, cur, items = [], [], 0
    for line in text.splitlines() + [""]:
        if _ITEM.match(line):
            cur.append(line)
            items += 1
        elif cur and line.strip() and line.startswith((" ", "\t")):
            cur.append(line)
        else:
            if items >= min_items:
                out.append("\n".join(cur))
            cur, items = [], 0
    return out


def training_texts(max_files: int | None = None) -> tuple[dict[str, list[tuple[str, str]]], dict]:
    """{kind: [(name, text)]} for TRAIN_KINDS ("dialogue": the openers) and where each came from."""
    stdlib = sysconfig.get_paths()["stdlib"]
    purelib = sysconfig.get_paths()["purelib"]
    kinds = {k: [] for k in TRAIN_KINDS}
    site_py = list(_walk(purelib, (".py",), SKIP_DIRS - {"site-packages"}))
    n = min(len(site_py), SITE_PY_FILES if max_files is None else max_files)
    modules = [("stdlib", stdlib, itertools.islice(_walk(stdlib, (".py",)), max_files)),
               ("site-packages", purelib, (site_py[i * len(site_py) // n] for i in range(n)))]
    for prefix, root, paths in modules:  # code, and its docstrings as docs
        for path in paths:
            text = _read(path)
            if text and len(text) > 400:
                name = f"{prefix}/{os.path.relpath(path, root)}"
                kinds["code"].append((name, text))
                kinds["docs"] += [(f"{name}#doc{j}", s) for j, s in enumerate(_docstrings(text, 300))]
    n_docs = 0
    for path in _walk(purelib, (".rst", ".md", ".txt"), SKIP_DIRS - {"site-packages"}):
        rel = os.path.relpath(path, purelib)
        if _LICENSE.search(rel) or (max_files is not None and n_docs >= max_files):
            continue
        text = _read(path)
        if text and len(text) > 400:
            n_docs += 1
            kinds["docs"].append(("site-packages/" + rel, text))
            kinds["lists"] += [(f"site-packages/{rel}#list{j}", b) for j, b in enumerate(list_blocks(text))]
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        name = f"metadata/{(dist.metadata['Name'] or '?').lower()}"
        if isinstance(body, str) and len(body) > 400:
            kinds["prose"].append((name, body))
            kinds["lists"] += [(f"{name}#list{j}", b) for j, b in enumerate(list_blocks(body))]
    kinds["dialogue"] = [(f"opener{i}", t) for i, t in enumerate(DIALOGUE_OPENERS)]
    info = dict(stdlib=stdlib, site_packages=purelib, texts={k: len(v) for k, v in kinds.items()},
                kind_sources=dict(code=f"standard library *.py, {n} site-packages *.py",
                                  docs="their docstrings, site-packages *.rst/*.md/*.txt",
                                  prose="installed distributions' METADATA descriptions",
                                  lists="bullet/numbered blocks of those docs and descriptions",
                                  dialogue="written openers, continued by the target's own samples"))
    return kinds, info


def _man_text(troff: str) -> str:
    """A manual page's words: requests and font escapes dropped."""
    lines = []
    for line in troff.splitlines():
        if line.startswith((".\\\"", "'\\\"", ".TH", ".so", ".de", ".ds", ".nr", ".if", ".ie", ".el")):
            continue
        if line.startswith("."):
            line = re.sub(r"^\.[A-Za-z]+\s*", "", line)
        line = re.sub(r"\\f\(..|\\f.|\\&|\\-", lambda m: "-" if m.group(0) == "\\-" else "", line)
        line = re.sub(r"\\\(..|\\[*](.)", "", line).replace('"', "")
        if line.strip() and not re.fullmatch(r"[-+\d.]+[mnvipu]?", line.strip()):  # indents left by .RS 2m
            lines.append(line.strip())
    return "\n".join(lines)


def heldout_texts(root: str = "/usr/share") -> dict[str, list[tuple[str, str]]]:
    """{kind: [(name, text)]} of the held-out kinds found under `root` (licenses, man pages, changelogs)."""
    out = {"legal": [], "manual": [], "changes": []}
    lic = os.path.join(root, "common-licenses")
    for fn in sorted(os.listdir(lic)) if os.path.isdir(lic) else []:
        text = _read(os.path.join(lic, fn))
        if text and len(text) > 2000:
            out["legal"].append((f"common-licenses/{fn}", text))
    man = os.path.join(root, "man", "man1")
    for fn in sorted(os.listdir(man)) if os.path.isdir(man) else []:
        if fn.startswith("gcloud"):  # thousands of one generated family: the other pages are the variety
            continue
        text = _read(os.path.join(man, fn))
        if text and len(text) > 3000:
            out["manual"].append((f"man1/{fn}", _man_text(text)))
    doc = os.path.join(root, "doc")
    for d in sorted(os.listdir(doc)) if os.path.isdir(doc) else []:
        text = _read(os.path.join(doc, d, "changelog.Debian.gz"))
        if text and len(text) > 2000:
            out["changes"].append((f"doc/{d}/changelog.Debian", text))
    return out
