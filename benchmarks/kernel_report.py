"""Turn kernel_bench's JSON lines into a markdown report and a PNG plot.

    python benchmarks/kernel_report.py RESULTS.jsonl [MORE.jsonl ...] --md OUT.md --png OUT.png
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict


Q4_G64_BYTES_PER_WEIGHT = 0.5625  # 4-bit codes + a bf16 scale and bias per 64 weights
COPY_TBPS = 4.3  # the H200's HBM copy bandwidth (docs/kernels.md, "The bytes floor")
COLORS = {"pallas (auto path)": "tab:orange", "pallas:qmv-per-row": "tab:red", "pallas:qmm-forced": "tab:green",
          "pallas:qmm-tiled": "tab:olive", "xla:dequant+dot": "tab:purple", "dense-bf16:jnp.dot": "tab:blue"}


def load(paths):
    rows = []
    for p in paths:
        rows += [json.loads(l) for l in open(p) if l.strip()]
    return rows


def launch_table(rows, phase, title, intro, columns, cells):
    """A markdown section for one launch-shape phase: N x K, rows, the phase's own columns
    (`cells(row, tiling)`), then us and % of floor. Empty when the phase has no timed rows."""
    timed = [r for r in rows if r["phase"] == phase and "us" in r]
    if not timed:
        return []
    cols = ["N x K", "rows", *columns, "us", "% of floor"]
    out = [f"## {title}", "", *([intro, ""] if intro else []),
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in timed:
        vals = [f"{r['n']}x{r['k']}", r["rows"], *cells(r, r["tiling"]), f"{r['us']:.1f}",
                f"{100 * r['floor_us'] / r['us']:.1f}"]
        out.append("| " + " | ".join(str(v) for v in vals) + " |")
    return out + [""]


def report(rows, md_path, png_path, command, note=None):
    envs = [r for r in rows if r["phase"] == "env"]
    env = envs[0]
    out = [f"# Quantized matmul kernels on the {env['device']} ({env['date'][:10]})", ""]
    for e in envs:  # one line per run (several JSON files may be merged)
        out += [f"JAX {e['jax']}, commit {e['commit']}, measured HBM (elementwise read+write) "
                f"{e['hbm_tbps']:.2f} TB/s, empty jitted call {e['empty_call_us']:.0f} us (subtracted).", ""]
    out += [f"Command: `{command}`", "",
           "Floor = bytes of packed weights + scales + biases / measured HBM bandwidth. Per-op time = "
           "(median call - empty call) / ops per call, each op with its own weight set and activations.", ""]
    if note:
        out += [note, ""]
    checks = [r for r in rows if r["phase"] == "check"]
    if checks:
        out += ["## Correctness on the GPU", "", "| N x K | rows | what | result |", "|---|---|---|---|"]
        for r in checks:
            what = r.get("what") or f"{r['path']} vs f32 reference (rel. error, bf16 x)"
            res = r.get("equal", r.get("rel_err"))
            out.append(f"| {r['n']}x{r['k']} | {r['rows']} | {what} | {res if not isinstance(res, float) else f'{res:.2e}'} |")
        out.append("")
    table = [r for r in rows if r["phase"] == "table" and "us" in r]
    if table:
        out += ["## Paths (bf16 activations, 4-bit g64 weights)", "",
                "% of floor: the 4-bit bytes at the run's measured bandwidth, and at the 4.3 TB/s of a copy "
                "(7.7 us for 15360x3840); the dense rows read 3.6x those bytes.", "",
                "| N x K | rows | backend | path | us | TB/s | % of 4-bit floor | % at 4.3 TB/s |",
                "|---|---|---|---|---|---|---|---|"]
        for r in table:
            at_copy_us = r["n"] * r["k"] * Q4_G64_BYTES_PER_WEIGHT / COPY_TBPS / 1e6
            pct = ("-", "-") if r["backend"] == "dense-bf16" else (
                f"{100 * r['floor_us'] / r['us']:.1f}", f"{100 * at_copy_us / r['us']:.1f}")
            out.append(f"| {r['n']}x{r['k']} | {r['rows']} | {r['backend']} | {r['path']} | {r['us']:.1f} "
                       f"| {r['tbps']:.2f} | {pct[0]} | {pct[1]} |")
        out.append("")
    tiles = [r for r in rows if r["phase"] == "tiles" and "us" in r]
    if tiles:
        out += ["## qmm tilings around the default (us)", ""]
        grid = defaultdict(dict)
        for r in tiles:
            grid[(r["n"], r["k"], r["rows"])][r["variant"]] = r["us"]
        cols = list(dict.fromkeys(c for d in grid.values() for c in d))
        out += ["The default splits K until about one wave of programs (132 SMs).", "",
                "| N x K | rows | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        for (n, k, rws), d in sorted(grid.items()):
            out.append(f"| {n}x{k} | {rws} | " + " | ".join(f"{d.get(c, float('nan')):.1f}" for c in cols) + " |")
        out.append("")
    out += launch_table(
        rows, "sweep", "GEMV launches around the default (rows 1 and 8)",
        "Explicit `launch.Tiling`s passed to `launch.gemv`; `xsum`: each group's sum(x) reduced in the "
        "kernel or summed once by the wrapper.",
        ["variant", "block_n", "split_k", "warps", "stages", "groups/step", "xsum"],
        lambda r, t: [r.get("variant", ""), t["block_n"], t["split_k"], t["num_warps"], t["num_stages"],
                      t["groups_per_step"], t.get("xsum", "reduce")])
    open(md_path, "w").write("\n".join(out))
    if png_path and table:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        shapes = sorted({(r["n"], r["k"]) for r in table})
        fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.6), squeeze=False)
        for ax, (n, k) in zip(axes[0], shapes):
            series = defaultdict(list)
            for r in table:
                if (r["n"], r["k"]) == (n, k):
                    auto = r["backend"] == "pallas" and r["path"] in ("qmv", "multirow", "qmm", "qmm (dense)")
                    series["pallas (auto path)" if auto else f"{r['backend']}:{r['path']}"].append((r["rows"], r["us"]))
            for name, pts in sorted(series.items()):
                ax.plot(*zip(*sorted(pts)), "o-", ms=3, label=name, color=COLORS.get(name))
            floor = next(r["floor_us"] for r in table if (r["n"], r["k"]) == (n, k) and r["backend"] == "pallas")
            ax.axhline(floor, color="gray", ls=":", label="4-bit floor")
            ax.set_xscale("log", base=2), ax.set_yscale("log"), ax.set_title(f"{n}x{k}", fontsize=9)
            ax.set_xlabel("rows"), ax.set_ylabel("us")
        handles = [plt.Line2D([], [], color=c, marker="o", ms=3, label=n) for n, c in COLORS.items()]
        handles.append(plt.Line2D([], [], color="gray", ls=":", label="4-bit floor"))
        axes[0][0].legend(handles=handles, fontsize=6)
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", default=None)
    ap.add_argument("--command", default="python benchmarks/kernel_bench.py --out $OUT")
    ap.add_argument("--note", default=None, help="a paragraph placed under the header")
    args = ap.parse_args()
    report(load(args.paths), args.md, args.png, args.command, args.note)


if __name__ == "__main__":
    main()
