"""The products on the CPU: snack's forward, dX and dW against the dense products in the same dtype.

    python bench/cpu.py                      # the whole grid, on all of PyTorch's threads
    python bench/cpu.py --quick              # 4096x4096 at 90%, a few batch sizes

For each weight shape (out x in), sparsity, batch size N and dtype: the forward Y = X W^T
(`snack.ops.spmm` against `x @ w.T`), the input gradient dX = dY W (`snack.ops.spmm_t` against
`dy @ w`) and the weight gradient (`snack.ops.sddmm`, at the stored positions only, against the dense
`dy.T @ x`). `snack` is the planner's choice; from N = 64, where it chooses between the CPU's sparse
loops and its dense blocks, both are also forced (`snack_loops`, `snack_dense_blocks`). The dense
weight is a random dense matrix (its time does not depend on the values), the sparse pattern
uniform random. Times are medians of repeated calls after a warm-up, on
torch.get_num_threads() threads; `gflops` is the useful rate, 2 x nnz x N (2 x M x K x N for dense)
per second. Writes bench/results/spmm_cpu.csv, .md and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import snack
from snack import benchmark

COLUMNS = ["op", "M", "K", "N", "sparsity", "dtype", "impl", "median_us", "gflops"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = ("fwd", "dx", "dw")


def median_us(fn, min_seconds: float, min_reps: int = 3) -> float:
    """Median time of fn() in microseconds: a warm-up call, then calls until both limits are met."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def dense_runs(m: int, k: int, n: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(m, k, generator=gen).to(dtype)
    x, dy = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, m, generator=gen).to(dtype)
    return {"fwd": lambda: x @ w.T, "dx": lambda: dy @ w, "dw": lambda: dy.T @ x}


# The CPU's two paths, forced: its sparse loops (any named variant but dense_blocks) and dense blocks.
PATHS = {"snack": ("auto", "auto"), "snack_loops": ("warp_row", "slot"),
         "snack_dense_blocks": ("dense_blocks", "dense_blocks")}


def sparse_runs(m: int, k: int, n: int, sparsity: float, dtype: torch.dtype, impl: str):
    nnz = snack.ops.nnz_for_density(m, k, 1.0 - sparsity)
    gen = torch.Generator().manual_seed(0)
    pattern = snack.Pattern.random(m, k, nnz, generator=gen)
    values = torch.randn(nnz, generator=gen).to(dtype)
    x, dy = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, m, generator=gen).to(dtype)
    tensors = pattern.tensors
    spmm_variant, sddmm_variant = PATHS[impl]
    return nnz, {"fwd": lambda: snack.ops.spmm(x, values, tensors, variant=spmm_variant),
                 "dx": lambda: snack.ops.spmm_t(dy, values, tensors, spmm_variant),
                 "dw": lambda: snack.ops.sddmm(dy, x, tensors, sddmm_variant)}


def grid(args):
    for m, k in args.shapes:
        for dtype in args.dtypes:
            for n in args.batches:
                yield m, k, n, dtype


def write_report(stem: Path, info: dict, rows: list[dict]) -> None:
    benchmark.write_csv(stem.with_suffix(".csv"), info, COLUMNS, rows)
    dense = {(r["op"], r["M"], r["K"], r["N"], r["dtype"]): r["median_us"] for r in rows if r["impl"] == "dense"}
    lines = benchmark.markdown_head("snack's products on the CPU against dense", info)
    lines += ["Microseconds (median) and snack's speedup over the dense product in the same dtype "
              "(`x @ w.T`, `dy @ w`, `dy.T @ x`); dW is computed at the stored positions only. Uniform random "
              "patterns.", ""]
    for op in OPS:
        lines += [f"### {op}", "", "| M x K | dtype | N | dense us | " +
                  " | ".join(f"{s:g}" for s in sorted({r['sparsity'] for r in rows if r['impl'] == 'snack'})) + " |"]
        sparsities = sorted({r["sparsity"] for r in rows if r["impl"] == "snack"})
        lines.append("|---|---|---|---|" + "---|" * len(sparsities))
        snack_rows = {(r["M"], r["K"], r["N"], r["dtype"], r["sparsity"]): r["median_us"]
                      for r in rows if r["impl"] == "snack" and r["op"] == op}
        for m, k, n, dt in sorted({key[:4] for key in snack_rows}, key=lambda t: (t[3], t[0], t[1], t[2])):
            d = dense[(op, m, k, n, dt)]
            cells = []
            for s in sparsities:
                us = snack_rows.get((m, k, n, dt, s))
                cells.append(f"{us:.0f} ({d / us:.2f}x)" if us else "-")
            lines.append(f"| {m}x{k} | {dt} | {n} | {d:.0f} | " + " | ".join(cells) + " |")
        lines.append("")
    forced = [r for r in rows if r["impl"] == "snack_loops"]
    if forced:
        us = {(r["op"], r["M"], r["K"], r["N"], r["dtype"], r["sparsity"], r["impl"]): r["median_us"] for r in rows}
        lines += ["### The planner's choice between the CPU's paths", "",
                  "Both paths forced at N >= 64 (`variant=\"warp_row\"` / `\"slot\"` run the loops, "
                  "`\"dense_blocks\"` the dense blocks): how often the planner's choice is within 10% of the faster "
                  "one, and its worst rows.", ""]
        worst, within = [], 0
        for r in forced:
            key = (r["op"], r["M"], r["K"], r["N"], r["dtype"], r["sparsity"])
            best = min(us[key + ("snack_loops",)], us[key + ("snack_dense_blocks",)])
            ratio = us[key + ("snack",)] / best
            within += ratio <= 1.1
            worst.append((ratio, key, us[key + ("snack_loops",)], us[key + ("snack_dense_blocks",)],
                          us[key + ("snack",)]))
        lines.append(f"- within 10% of the faster path in {within} of {len(forced)} rows")
        lines += ["", "| op | M x K | dtype | N | sparsity | loops us | dense blocks us | planner us "
                  "| planner / best |", "|---|---|---|---|---|---|---|---|---|"]
        for ratio, (op, m, k, n, dt, sp), a, b, c in sorted(worst, reverse=True)[:8]:
            lines.append(f"| {op} | {m}x{k} | {dt} | {n} | {sp:g} | {a:.0f} | {b:.0f} | {c:.0f} | {ratio:.2f}x |")
        lines.append("")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = benchmark.pyplot()
    if plt is None:
        return
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(len(dtypes), len(OPS), figsize=(4 * len(OPS), 3.2 * len(dtypes)), squeeze=False)
    big = max({(r["M"], r["K"]) for r in rows}, key=lambda s: s[0] * s[1])
    for i, dt in enumerate(dtypes):
        for j, op in enumerate(OPS):
            ax = axes[i][j]
            for s in sorted({r["sparsity"] for r in rows if r["impl"] == "snack"}):
                pts = sorted((r["N"], dense[(op, r["M"], r["K"], r["N"], dt)] / r["median_us"]) for r in rows
                             if r["impl"] == "snack" and r["op"] == op and r["dtype"] == dt and r["sparsity"] == s
                             and (r["M"], r["K"]) == big)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{s:g}")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_title(f"{op}, {dt}, {big[0]}x{big[1]}", fontsize=9)
            ax.set_xlabel("N")
            ax.set_ylabel("speedup over dense")
            ax.legend(fontsize=7, title="sparsity", title_fontsize=7)
    fig.suptitle(f"snack on the CPU ({info['cpu']}, {info['threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4096x4096 at 90%%, N = 1, 16, 128, fp32")
    parser.add_argument("--shapes", default="768x3072,3072x768,4096x4096", help="out x in, comma-separated")
    parser.add_argument("--sparsities", default="0.5,0.7,0.9,0.95,0.99")
    parser.add_argument("--batches", default="1,8,32,128,512")
    parser.add_argument("--dtypes", default="fp32,bf16", help="of " + ", ".join(DTYPES))
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time each case for at least this long")
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    parser.add_argument("--tag", default="", help="results in spmm_cpu_<tag>.* (a variant's run beside the main file)")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.sparsities, args.batches, args.dtypes = "4096x4096", "0.9", "1,16,128", "fp32"
    args.shapes = benchmark.shape_list(args.shapes)
    args.sparsities = benchmark.number_list(args.sparsities, kind=float)
    args.batches = benchmark.number_list(args.batches)
    args.dtypes = args.dtypes.split(",")
    unknown = set(args.dtypes) - set(DTYPES)
    if unknown:
        parser.error(f"unknown dtypes {sorted(unknown)}: expected some of {', '.join(DTYPES)}")
    info = benchmark.provenance(torch.device("cpu"))
    info["cpu"] = benchmark.cpu_name()
    info["threads"] = str(torch.get_num_threads())
    knobs = [f"{name}={os.environ[name]}" for name in ("SNACK_CPU_BASELINE", "SNACK_CPU_BF16_DOT") if name in os.environ]
    if knobs:
        info["environment"] = " ".join(knobs)
    rows = []
    cases = list(grid(args))
    for m, k, n, dt in benchmark.progress(cases, len(cases), "cpu"):
        dtype = DTYPES[dt]
        for op, fn in dense_runs(m, k, n, dtype).items():
            us = median_us(fn, args.min_seconds)
            rows.append(dict(op=op, M=m, K=k, N=n, sparsity=0.0, dtype=dt, impl="dense", median_us=us,
                             gflops=2 * m * k * n / us / 1e3))
        for s in args.sparsities:
            # Each path forced where the planner chooses between them (N >= 64), beside its choice.
            for impl in PATHS if n >= 64 else ("snack",):
                nnz, runs = sparse_runs(m, k, n, s, dtype, impl)
                for op, fn in runs.items():
                    us = median_us(fn, args.min_seconds)
                    rows.append(dict(op=op, M=m, K=k, N=n, sparsity=s, dtype=dt, impl=impl, median_us=us,
                                     gflops=2 * nnz * n / us / 1e3))
    stem = args.out / ("spmm_cpu_" + args.tag if args.tag else "spmm_cpu")
    write_report(stem, info, rows)
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
