"""Does the default pair write Python? The plausibility of greedy completions of held-out functions.

    python -m jaxspec.train.quality [--path DIR] [--n 40] [--max-tokens 64] [--json]

The procedure, fixed so that two pairs' scores compare (docs/default-pair.md):
1. Prompts: every function definition (`ast`) in the pair's held-out files, in (file, line) order,
   as the source of its header (the `def` line through the line that ends it, decorators and
   comment lines after it left out, dedented, ending at its colon), when its body starts on a
   later line, leaving out any whose tokens plus `max_tokens` pass the model's context; `n` of
   them evenly spaced over that list.
2. Each prompt is completed greedily, `max_tokens` tokens. The prompt stops at the colon, not after
   the newline: the newline and the indentation are the model's to write (a byte-level BPE merges
   them with the colon, so a prompt ending in a bare newline is one the model never saw).
3. Header + completion is cut after the header's lines to whole lines (a last line without its
   newline is dropped) and at the end of the function (the first non-blank line not indented past
   the `def`).
4. It is plausible iff the cut body holds a non-blank line and `ast.parse` accepts header + body,
   or accepts it once cut at the last complete statement: the longest prefix of whole lines that
   parses, where the rest is an unfinished statement (`codeop` finds it incomplete, not invalid).
The score is the plausible share. Greedy output is the same with and without the assistant, so
classic decoding scores the pair.
"""
from __future__ import annotations

import argparse
import ast
import codeop
import json
import os
import sys
import textwrap
import warnings


def signature_prompts(files) -> list[dict]:
    """`files`: [(relative path, text)]. Every function header whose body starts on a later line:
    dicts with file, line (1-based) and text (the dedented header, ending with its colon)."""
    out = []
    for rel, text in sorted(files):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            end = node.body[0].lineno - 1  # the header's last line (1-based)
            if node.body[0].lineno == node.lineno or end < node.lineno:
                continue  # a one-line function: its body is on the header's line
            head = lines[node.lineno - 1:end]
            while head and head[-1].strip().startswith("#") or head and not head[-1].strip():
                head.pop()  # comment lines between the header and the body
            header = textwrap.dedent("".join(head)).rstrip()
            if _parses(header + "\n    pass\n"):
                out.append(dict(file=rel, line=node.lineno, text=header))
    out.sort(key=lambda p: (p["file"], p["line"]))
    return out


def fitting(prompts: list, tok, context: int, max_tokens: int) -> list:
    """The prompts whose tokens leave room for `max_tokens` more within `context` positions."""
    return [p for p in prompts if len(tok.encode(p["text"]).ids) + max_tokens <= context]


def pick(prompts: list, n: int) -> list:
    """`n` prompts evenly spaced over the list (all of them when it is shorter)."""
    if len(prompts) <= n:
        return list(prompts)
    return [prompts[i * len(prompts) // n] for i in range(n)]


def procedure_prompts(files, tok, context: int, max_tokens: int, n: int) -> list:
    """Step 1 of the procedure: `n` of the held-out `files`' signatures that fit `context`."""
    return pick(fitting(signature_prompts(files), tok, context, max_tokens), n)


def cut(completion: str) -> str:
    """Whole lines of the completion, up to the end of the function it continues."""
    lines = completion.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    body = []
    for line in lines:
        if line.strip() and not line[:1].isspace():
            break  # back at the def's indentation: the function ended
        body.append(line)
    return "".join(body)


def _parses(src: str) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(src)
        return True
    except (SyntaxError, ValueError):
        return False


def _incomplete(src: str) -> bool:
    """Whether `src` is a valid start of Python that more lines would finish (`codeop`)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return codeop.compile_command(src, "<completion>", "exec") is None
    except (SyntaxError, ValueError, OverflowError):
        return False


def plausible(header: str, completion: str) -> bool:
    """Steps 3 and 4 of the procedure: `header` the prompt (ending at its colon), `completion` the
    text generated after it."""
    lines = (header + completion).splitlines(keepends=True)
    n = header.count("\n") + 1  # the header's lines; the model may write a comment after the colon
    if len(lines) <= n:
        return False
    header, body = "".join(lines[:n]), cut("".join(lines[n:]))
    if not body.strip():
        return False
    if _parses(header + body):
        return True
    if not _incomplete(header + body):
        return False
    lines = body.splitlines(keepends=True)
    return any(_parses(header + "".join(lines[:j])) for j in range(len(lines) - 1, 0, -1)
               if "".join(lines[:j]).strip())


def score(target, tok, prompts: list[dict], max_tokens: int = 64) -> dict:
    """Greedy completions of `prompts` (signature_prompts' dicts) by `target`: the plausible share
    and each prompt's completion."""
    import jaxspec

    rows = []
    for p in prompts:
        ids = tok.encode(p["text"]).ids
        out = jaxspec.generate(target, [ids], max_new_tokens=max_tokens, block_size=1)
        text = tok.decode(out.tokens[0])
        rows.append(dict(file=p["file"], line=p["line"], prompt=p["text"], completion=text,
                         plausible=plausible(p["text"], text)))
    share = sum(r["plausible"] for r in rows) / len(rows) if rows else 0.0
    return dict(plausibility=share, n=len(rows), max_tokens=max_tokens, rows=rows)


def heldout_files(path: str | None = None, stdlib: str | None = None) -> list[tuple[str, str]]:
    """The pair's held-out files (its metrics.json lists them), read where this machine has them:
    for a pair trained on `corpus.collect`'s sources, each source's recorded root or else where it
    is installed here; for one trained on the stdlib alone, `stdlib` (default: the recorded one if
    it exists, else this interpreter's). Files this machine lacks are left out."""
    import sysconfig

    from jaxspec.train import corpus as corpus_mod
    from jaxspec.default_pair import default_pair_metrics

    corpus = default_pair_metrics(path)["corpus"]
    if "sources" in corpus:  # names are <source>/<path in source>
        local = corpus_mod.source_roots(tuple(s for s in corpus["sources"] if s != "stdlib"))
        roots = {src: info["root"] if info["root"] and os.path.isdir(info["root"]) else local.get(src)
                 for src, info in corpus["sources"].items()}
        if stdlib is not None:
            roots["stdlib"] = stdlib
        where = [(name, roots.get(name.split("/", 1)[0]), name.split("/", 1)[1]) for name in corpus["heldout_files"]]
    else:
        if stdlib is None:
            stdlib = corpus["stdlib"] if os.path.isdir(corpus["stdlib"]) else sysconfig.get_paths()["stdlib"]
        where = [(rel, stdlib, rel) for rel in corpus["heldout_files"]]
    files = []
    for name, root, rel in where:
        fn = os.path.join(root, rel) if root else None
        if fn and os.path.exists(fn):
            with open(fn, encoding="utf-8") as f:
                files.append((name, f.read()))
    if not files:
        raise ValueError("none of the pair's held-out files is on this machine")
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default=None, help="a pair directory (default: the shipped pair)")
    ap.add_argument("--stdlib", default=None, help="where to read the held-out files")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--show", type=int, default=3, help="print this many completions")
    ap.add_argument("--json", metavar="FILE", help="also write every completion here")
    args = ap.parse_args(argv)
    import jax

    from jaxspec.kernels import DispatchConfig

    from jaxspec.default_pair import load_default_pair

    matmul = None if jax.default_backend() == "gpu" else DispatchConfig(backend="xla")  # Pallas interpret is slow
    target, _, tok = load_default_pair(matmul=matmul, path=args.path)
    files = heldout_files(args.path, args.stdlib)
    prompts = procedure_prompts(files, tok, target.config.max_position_embeddings, args.max_tokens, args.n)
    result = score(target, tok, prompts, args.max_tokens)
    for r in result["rows"][:args.show]:
        print(f"--- {r['file']}:{r['line']} ({'plausible' if r['plausible'] else 'not plausible'})")
        print(r["prompt"] + r["completion"])
    print(f"plausibility {result['plausibility']:.3f} ({sum(r['plausible'] for r in result['rows'])}/{result['n']} "
          f"held-out signatures, {args.max_tokens} greedy tokens, {len(files)} held-out files)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
