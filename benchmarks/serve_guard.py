"""The serving guard: the standard serve sweep and the long/short workload, one commit against another.

    python benchmarks/serve_guard.py prepare OLD_COMMIT           # here: OLD's tree into .carry/serve-old
    python benchmarks/serve_guard.py run --out DIR/new            # device call 1: this tree
    python benchmarks/serve_guard.py run --tree .carry/serve-old --out DIR/old   # device call 2: the old tree
    python benchmarks/serve_guard.py compare DIR/old DIR/new --out docs/benchmark_results/FILE.md
    python benchmarks/serve_guard.py run --parts budget,budget-long --out DIR/budget   # the step budget sweep
    python benchmarks/serve_guard.py budgets DIR/budget --out docs/benchmark_results/FILE.md
    python benchmarks/serve_guard.py run --no-prefix-cache --out DIR/off   # prefix reuse's cost: reuse off,
    python benchmarks/serve_guard.py compare DIR/off DIR/on --drop 0.97    # against `run --out DIR/on`
    python benchmarks/serve_guard.py run --parts sweep --clients 32 --out DIR/on   # little device time left

Any change to serving code (the batch engine, the scheduler, the server, the paged pool, the kernels a
decode step runs) runs it against the previous main in one device lease, the two `run`s back to back
(device calls, each under 10 minutes), and commits the comparison. `prepare` writes the old commit's
tree without the default pair's weights (the 12b preset does not need them) and its sha in
`.carry/serve-old/COMMIT`; name `.carry/serve-old` in the device call's carry.

`run` (in `--tree`, default this checkout) runs that tree's own benchmarks/serve_bench.py on the 12B
preset (random 4-bit weights, K = 1, 4 rounds a step, 64-token prompts, 64 new tokens):
- sweep: engine and HTTP rows, 1 / 8 / 32 clients, greedy and mixed sampling, 8 requests per client,
  each row the median of 3 runs (a tree whose serve_bench has no `--repeats`: 1 run, said in the table);
- long: 8 streams, then one 16,384-token request, at the tree's default prefill settings.
- budget, budget-long (issue 66: the default of `--step-tokens`): the sweep at 32 clients (engine and HTTP,
  greedy) and the long workload, once per budget of `run --step-tokens` (default 512,2048,8192);
  `budgets` tabulates throughput at 32 clients against the long workload's p99 gap and first token.
`compare` puts the two runs' rows side by side, marks a drop of more than 5% (exit status 1), and
checks the serving issue's targets on the new run (HTTP greedy at 32 clients >= 3,000 tok/s; 8 clients
>= 7x one; mixed >= 0.85x greedy at 32; the streams' p99 gap <= 3x and <= 40 ms beside the long
request, its first token <= 2.0 s). `--drop` sets the bar (prefix reuse's issue allows 3% against reuse
off: `run --no-prefix-cache` is the old run, the same tree's default the new one).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD = os.path.join(ROOT, ".carry", "serve-old")
DROP = 0.95  # new / old below this is a regression (the project's 5% rule; `compare --drop` sets another)

SWEEP = ["--target", "12b", "--k-values", "1", "--max-slots", "32", "--rounds-per-step", "4", "--prompt-len", "64",
         "--max-tokens", "64", "--clients", "1,8,32", "--sampling", "greedy,mixed", "--requests-per-client", "8",
         "--http", "--quiet"]
LONG = ["--target", "12b", "--long-prompt", "16384", "--long-tokens", "64", "--clients", "8", "--prompt-len", "64",
        "--max-tokens", "64", "--rounds-per-step", "1", "--baseline-s", "10", "--k-values", "1", "--quiet"]
BUDGET = ["--target", "12b", "--k-values", "1", "--max-slots", "32", "--rounds-per-step", "4", "--prompt-len", "64",
          "--max-tokens", "64", "--clients", "32", "--sampling", "greedy", "--requests-per-client", "8", "--http",
          "--quiet"]
STEP_TOKENS = "512,2048,8192"  # Sarathi-Serve's strict budget, vLLM's online default off the H100, its H200 one
# seconds each may take; budget and budget-long fit one device call together, sweep and long another
PARTS = {"sweep": (SWEEP, 420), "long": (LONG, 150), "budget": (BUDGET, 330), "budget-long": (LONG, 240)}

TARGETS = [  # (what, check(new rows) -> (value, met))
    "HTTP greedy, 32 clients >= 3,000 tok/s", "HTTP greedy, 8 clients >= 7.0x one client",
    "HTTP mixed >= 0.85x greedy at 32 clients", "long/short p99 gap <= 3x without it and <= 40 ms",
    "long request's first token <= 2.0 s"]


def prepare(commit: str, dest: str = OLD) -> int:
    """The old commit's tree (no model weights: the default pair's, the shipped drafters') in `dest`, its
    sha beside it: it travels with a device call, which carries at most 64 MiB."""
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", commit], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["rm", "-rf", dest], check=True)
    os.makedirs(dest)
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest, "--exclude=*/default_pair/*/model.safetensors",
                    "--exclude=*/data/drafters/*/model.safetensors",
                    "--exclude=docs/benchmark_results/raw", "--exclude=docs/notebooks"], stdin=archive.stdout, check=True)
    if archive.wait():
        raise SystemExit(f"git archive {sha} failed")
    with open(os.path.join(dest, "COMMIT"), "w") as f:
        f.write(sha + "\n")
    print(f"{dest}: {sha}; carry '.carry/serve-old' and run `python3 benchmarks/serve_guard.py run --tree "
          f".carry/serve-old --out $OUT/old`")
    return 0


def run(tree: str, out: str, commit: str | None, parts: list[str], step_tokens: str = STEP_TOKENS,
        prefix_cache: bool = True, clients: str | None = None) -> int:
    """Each part's serve_bench in `tree` (its own code, on PYTHONPATH), logged under `out`; the budget
    parts once per budget of `step_tokens`; with `prefix_cache` False, every part with reuse off;
    `clients` (e.g. "32") in place of the sweep's 1,8,32, when the device time left is short."""
    tree = os.path.abspath(tree)
    if clients is not None and not all(c.isdigit() and int(c) > 0 for c in clients.split(",")):
        raise SystemExit(f"--clients {clients!r}: expected client counts, comma-separated (e.g. 32 or 1,8,32)")
    if commit is None:
        stamp = os.path.join(tree, "COMMIT")
        commit = open(stamp).read().strip() if os.path.exists(stamp) else subprocess.run(
            ["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    bench = os.path.join(tree, "benchmarks", "serve_bench.py")
    with open(bench) as f:
        source = f.read()  # the tree's serve_bench may predate a flag
    repeats = ["--repeats", "3"] if "--repeats" in source else []
    if not prefix_cache and "--no-prefix-cache" not in source:
        raise SystemExit(f"--no-prefix-cache: {bench} has no such flag (a tree from before prefix reuse)")
    reuse = [] if prefix_cache else ["--no-prefix-cache"]
    # the tree first; what was on the path stays after it (carried wheels: fastapi, uvicorn on the device)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p),
               PYTHONUNBUFFERED="1")
    os.makedirs(out, exist_ok=True)
    status = 0
    for part in parts:
        args, limit = PARTS[part]
        if clients and part == "sweep":
            args = [clients if i and args[i - 1] == "--clients" else a for i, a in enumerate(args)]
        budgets = ["--step-tokens", step_tokens] if part.startswith("budget") else []
        cmd = [sys.executable, bench, *args, *(repeats if part == "sweep" else []), *budgets, *reuse,
               "--commit", commit, "--out", os.path.join(out, part)]
        t0 = time.perf_counter()
        with open(os.path.join(out, f"{part}.log"), "w") as log:
            try:
                rc = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        print(f"== {part}: rc {rc} in {time.perf_counter() - t0:.0f} s ({' '.join(cmd[1:])})", flush=True)
        status = status or rc
    with open(os.path.join(out, "guard.json"), "w") as f:
        sweep = PARTS["sweep"][0]
        json.dump(dict(tree=tree, commit=commit, parts=parts, repeats=bool(repeats), prefix_cache=prefix_cache,
                       **({"clients": clients or sweep[sweep.index("--clients") + 1]} if "sweep" in parts else {})), f)
    return status


def _rows(d: str, name: str) -> list[dict]:
    path = os.path.join(d, name.split("/")[0], name.split("/")[1])
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["rows"]


def targets(sweep: list[dict], long: list[dict]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for the serving issue's targets, from one run's rows."""
    http = {(r["sampling"], r["clients"]): r["tokens_per_s"] for r in sweep if r["mode"] == "http"}
    out = []
    g32, g8, g1, m32 = (http.get(k) for k in (("greedy", 32), ("greedy", 8), ("greedy", 1), ("mixed", 32)))
    out.append((TARGETS[0], f"{g32:.0f} tok/s" if g32 else "not run", bool(g32 and g32 >= 3000)))
    out.append((TARGETS[1], f"{g8 / g1:.2f}x" if g8 and g1 else "not run", bool(g8 and g1 and g8 >= 7.0 * g1)))
    out.append((TARGETS[2], f"{m32 / g32:.2f}x" if m32 and g32 else "not run", bool(m32 and g32 and m32 >= 0.85 * g32)))
    r = long[0] if long else None
    out.append((TARGETS[3], f"{r['p99_ratio']:.2f}x, {r['gap_p99_during_ms']:.1f} ms" if r else "not run",
                bool(r and r["p99_ratio"] <= 3.0 and r["gap_p99_during_ms"] <= 40.0)))
    out.append((TARGETS[4], f"{r['long_ttft_s']:.2f} s" if r else "not run", bool(r and r["long_ttft_s"] <= 2.0)))
    return out


def budgets(d: str, out: str | None) -> int:
    """The budget parts of one run: per step budget, tokens/s and TTFT at 32 clients (engine, HTTP)
    beside the long workload's stream gaps and the long request's first token."""
    sweep, long = _rows(d, "budget/serve.json"), {r["step_tokens"]: r for r in _rows(d, "budget-long/serve_long.json")}
    lines = ["| step tokens (lanes) | engine tok/s at 32 | HTTP tok/s at 32 | HTTP TTFT median ms | "
             "long: p99 gap during ms | p99 during / before | long request's first token s |",
             "|---|---|---|---|---|---|---|"]
    for budget in sorted({r["step_tokens"] for r in sweep} | set(long)):
        rows = {r["mode"]: r for r in sweep if r["step_tokens"] == budget}
        lanes = next((r["lanes"] for r in [*rows.values(), long.get(budget)] if r), "?")
        cell = lambda r, f, s=1.0: f"{r[f] * s:.0f}" if r else "-"  # noqa: E731
        g = long.get(budget)
        lines.append(f"| {budget} ({lanes}) | {cell(rows.get('engine'), 'tokens_per_s')} | "
                     f"{cell(rows.get('http'), 'tokens_per_s')} | {cell(rows.get('http'), 'ttft_median_s', 1e3)} | "
                     + (f"{g['gap_p99_during_ms']:.1f} | {g['p99_ratio']:.2f}x | {g['long_ttft_s']:.2f} |" if g
                        else "- | - | - |"))
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text)
    return 0


def compare(old: str, new: str, out: str | None, drop: float = DROP) -> int:
    """The two runs side by side; exit status 1 when a row's new / old is below `drop`."""
    meta = {}
    for name, d in (("old", old), ("new", new)):
        path = os.path.join(d, "guard.json")
        meta[name] = json.load(open(path)) if os.path.exists(path) else {"commit": "?", "repeats": False}
    sweeps = {n: {(r["mode"], r["sampling"], r["clients"]): r for r in _rows(d, "sweep/serve.json")}
              for n, d in (("old", old), ("new", new))}
    longs = {n: _rows(d, "long/serve_long.json") for n, d in (("old", old), ("new", new))}
    name = lambda m: m["commit"][:12] + ("" if m.get("prefix_cache", True) else " (prefix reuse off)")  # noqa: E731
    lines = [f"# serve guard: {name(meta['new'])} against {name(meta['old'])}", "",
             "Rows: tok/s (all tokens over the wall time; "
             + ", ".join(f"{n}: {'median of 3 runs' if meta[n].get('repeats') else '1 run'}" for n in ("old", "new"))
             + "), TTFT median, per-stream tok/s.", "",
             "| path | sampling | clients | old tok/s | new tok/s | new / old | old TTFT ms | new TTFT ms | "
             "old stream tok/s | new stream tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    drops = []
    for key in sorted(set(sweeps["old"]) | set(sweeps["new"]), key=lambda k: (k[0], k[1], k[2])):
        o, n = sweeps["old"].get(key), sweeps["new"].get(key)
        ratio = n["tokens_per_s"] / o["tokens_per_s"] if o and n else None
        flag = " **drop**" if ratio is not None and ratio < drop else ""
        if flag:
            drops.append(key)
        cell = lambda r, f, s=1.0, fmt="{:.0f}": fmt.format(r[f] * s) if r else "-"  # noqa: E731
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {cell(o, 'tokens_per_s')} | {cell(n, 'tokens_per_s')} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'}{flag} | {cell(o, 'ttft_median_s', 1e3)} | "
                     f"{cell(n, 'ttft_median_s', 1e3)} | {cell(o, 'stream_tokens_per_s', 1, '{:.1f}')} | "
                     f"{cell(n, 'stream_tokens_per_s', 1, '{:.1f}')} |")
    lines += ["", "| long/short workload | old | new |", "|---|---|---|"]
    for field, label, fmt in (("p99_ratio", "streams' p99 gap during / before", "{:.2f}x"),
                              ("gap_p99_during_ms", "p99 gap during (ms)", "{:.1f}"),
                              ("long_ttft_s", "long request's first token (s)", "{:.2f}"),
                              ("long_total_s", "long request done (s)", "{:.2f}")):
        got = [fmt.format(longs[n][0][field]) if longs[n] else "not run" for n in ("old", "new")]
        lines.append(f"| {label} | {got[0]} | {got[1]} |")
    lines += ["", "| target (new run) | measured | met |", "|---|---|---|"]
    lines += [f"| {t} | {v} | {'yes' if ok else 'no'} |"
              for t, v, ok in targets(list(sweeps["new"].values()), longs["new"])]
    dropped = ", ".join(f"{k[0]} {k[1]} {k[2]} clients" for k in drops) or "none"
    lines += ["", f"Drops over {1 - drop:.0%}: {dropped}."]
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text)
    return 1 if drops else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="the old commit's tree into .carry/serve-old")
    p.add_argument("commit")
    p.add_argument("--dest", default=OLD)
    r = sub.add_parser("run", help="the sweep and the long workload in one tree")
    r.add_argument("--tree", default=ROOT)
    r.add_argument("--out", required=True)
    r.add_argument("--commit", default=None, help="default: the tree's COMMIT file, else its git HEAD")
    r.add_argument("--parts", default="sweep,long", help="comma-separated: sweep, long, budget, budget-long")
    r.add_argument("--step-tokens", default=STEP_TOKENS, help="the budget parts' budgets (comma-separated)")
    r.add_argument("--no-prefix-cache", action="store_true", help="every part with prefix reuse off")
    r.add_argument("--clients", default=None, help="the sweep's client counts (default 1,8,32), e.g. 32 alone")
    b = sub.add_parser("budgets", help="the budget parts of a run as one table")
    b.add_argument("dir")
    b.add_argument("--out", default=None)
    c = sub.add_parser("compare", help="two runs side by side")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--out", default=None)
    c.add_argument("--drop", type=float, default=DROP, help="new / old below this is a drop (default 0.95)")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        return prepare(args.commit, args.dest)
    if args.cmd == "run":
        parts = [x for x in args.parts.split(",") if x]
        bad = sorted(set(parts) - set(PARTS))
        if bad:
            raise SystemExit(f"--parts: unknown {bad} ({', '.join(PARTS)})")
        return run(args.tree, args.out, args.commit, parts, args.step_tokens, not args.no_prefix_cache, args.clients)
    if args.cmd == "budgets":
        return budgets(args.dir, args.out)
    if not 0 < args.drop <= 1:
        raise SystemExit(f"--drop: {args.drop} is not in (0, 1]")
    return compare(args.old, args.new, args.out, args.drop)


if __name__ == "__main__":
    sys.exit(main())
