"""The weight gradient over the tile view: each of its kernels forced, against the planner's and dense.

dW = dY^T X at the stored slots in 16 bits, by `tile_view` (mma.sync) and `tile_view_wgmma` (Hopper's
wgmma, with one and with two warpgroups a block, `snack.fragment_warpgroups`), beside the planner's
choice and cuBLAS's whole `dY.t() @ x`: the evidence for the planner's rules (`tile_view_wgmma_pays`,
`tile_view_wgmma_groups` in src/sddmm/plan.cpp). Each kernel is checked against float64 first.

    python bench/dw_tile_view.py
    python bench/dw_tile_view.py --shapes 16384x4096 --ns 64,128 --tag large

Writes bench/results/dw_tile_view_<gpu>_<dtype>[_<tag>].{csv,md,png}.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
from pathlib import Path

import torch

import snack
from snack import benchmark

try:  # run as a script (python bench/dw_tile_view.py), or imported as bench.dw_tile_view
    from spmm import make_pattern
except ImportError:
    from bench.spmm import make_pattern

SHAPES = [(16384, 4096), (11008, 4096), (4096, 4096), (768, 3072)]
SPARSITIES = [0.8, 0.9, 0.95]
NS = [1, 8, 16, 32, 64, 128]
# (impl, variant forced, warpgroups a block for the wgmma kernel); "snack" is the planner's choice.
PATHS = [("snack", "auto", 0), ("tile_view", "tile_view", 0), ("wgmma_1", "tile_view_wgmma", 1),
         ("wgmma_2", "tile_view_wgmma", 2), ("dense", None, 0)]
COLUMNS = ["M", "K", "N", "sparsity", "dtype", "impl", "median_us", "planner", "rel_error"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="e.g. 4096x4096,16384x4096")
    parser.add_argument("--sparsities", default=None, help="e.g. 0.9,0.95")
    parser.add_argument("--ns", default=None, help="batch rows, at most 128")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/dw_tile_view.py needs a CUDA GPU")
        return 1
    shapes = benchmark.shape_list(args.shapes, SHAPES)
    sparsities = benchmark.number_list(args.sparsities, SPARSITIES, float)
    ns = benchmark.number_list(args.ns, NS)
    dtype = benchmark.DTYPES[args.dtype]
    info = benchmark.provenance()
    info["method"] = (f"median of {args.reps} single calls, {benchmark.ColdTimer.METHOD}; {args.dtype}; "
                      "each kernel forced with snack.ops.sddmm(variant=...), the wgmma kernel's warpgroups a block "
                      "with snack.fragment_warpgroups")
    timer = benchmark.ColdTimer()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, failures, skipped = [], [], []
    configs = list(itertools.product(shapes, sparsities))
    for (m, k), sparsity in benchmark.progress(configs, len(configs), "dw_tile_view"):
        pattern = make_pattern(m, k, sparsity, "uniform", gen)
        values = torch.randn(pattern.nnz, device="cuda", generator=gen).to(dtype)
        t = pattern.tensors
        for n in ns:
            x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
            dy = torch.randn(n, m, device="cuda", generator=gen).to(dtype)
            full = dy.double().t() @ x.double()
            ref = full[pattern.row_idx.long(), pattern.col_idx.long()]
            planner = snack.Plan(*snack.ops.explain(values, t, n, "weight_grad")).variant
            for impl, variant, groups in PATHS:
                if variant is None:
                    fn, want = (lambda: dy.t() @ x), full
                else:
                    fn, want = (lambda v=variant: snack.ops.sddmm(dy, x, t, v)), ref
                scope = snack.fragment_warpgroups(groups) if groups else contextlib.nullcontext()
                with scope:
                    try:
                        err = benchmark.rel_error(fn(), want)
                    except ValueError as exc:  # a kernel this GPU or product cannot run
                        skipped.append(f"{impl} {m}x{k} N={n}: {exc}")
                        continue
                    if not err < benchmark.TOLERANCE[args.dtype]:
                        failures.append(f"{impl} {m}x{k} N={n} s={sparsity}: rel error {err:.2e}")
                        continue
                    us = timer.median_us(fn, reps=args.reps)
                rows.append(dict(M=m, K=k, N=n, sparsity=sparsity, dtype=args.dtype, impl=impl, median_us=us,
                                 planner=planner, rel_error=err))
    name = f"dw_tile_view_{benchmark.gpu_slug()}_{args.dtype}" + (f"_{args.tag}" if args.tag else "")
    benchmark.write_csv(args.out / f"{name}.csv", info, COLUMNS, rows)
    md = summarize(rows, info, failures, skipped)
    (args.out / f"{name}.md").write_text(md)
    plot(rows, args.out / f"{name}.png", info)
    print(md)
    return 1 if failures else 0


def problems(rows) -> dict:
    """The rows by problem (M, K, N, sparsity): ({impl: time}, the planner's variant)."""
    out = {}
    for r in rows:
        key = (r["M"], r["K"], r["N"], r["sparsity"])
        out.setdefault(key, ({}, r["planner"]))[0][r["impl"]] = r["median_us"]
    return out


def summarize(rows, info, failures=(), skipped=()) -> str:
    lines = benchmark.markdown_head("Weight gradient over the tile view: each kernel", info)
    impls = [impl for impl, _, _ in PATHS]
    lines += ["Median us, cold L2. snack: the planner's kernel (`planner`); tile_view: the mma.sync kernel; "
              "wgmma_1 / wgmma_2: `tile_view_wgmma` with one / two warpgroups a block; dense: cuBLAS's whole "
              "`dY.t() @ x`. `best sparse`: the fastest of the forced kernels; `planner / best`: the planner's "
              "time over it; `dense / snack`: above 1, snack is faster.", "",
              "| M x K | N | sparsity | " + " | ".join(impls) + " | planner | best sparse | planner / best "
              "| dense / snack |", "|---|---|---|" + "---|" * (len(impls) + 4)]
    to_best, to_dense = [], []
    for (m, k, n, sparsity), (times, planner) in problems(rows).items():
        forced = {i: v for i, v in times.items() if i not in ("snack", "dense")}
        best = min(forced, key=forced.get) if forced else "-"
        ratio = times["snack"] / forced[best] if forced and "snack" in times else float("nan")
        vs_dense = times["dense"] / times["snack"] if "dense" in times and "snack" in times else float("nan")
        to_best.append(ratio)
        to_dense.append(vs_dense)
        cells = " | ".join(f"{times[i]:.1f}" if i in times else "-" for i in impls)
        lines.append(f"| {m}x{k} | {n} | {sparsity} | {cells} | {planner} | {best} | {ratio:.2f} | {vs_dense:.2f}x |")
    finite = [v for v in to_best if v == v]
    if finite:
        lines += ["", f"- the planner's kernel runs {benchmark.geomean(finite):.3f}x the best forced kernel's time in "
                  f"geometric mean over {len(finite)} problems, {max(finite):.2f}x at worst"]
    finite = [v for v in to_dense if v == v]
    if finite:
        lines.append(f"- dense / snack: {benchmark.geomean(finite):.2f}x in geometric mean; snack faster in "
                     f"{sum(v > 1 for v in finite)} of {len(finite)} problems")
    if failures:
        lines += ["", f"**{len(failures)} runs failed the reference check**, e.g. {failures[0]}"]
    if skipped:
        lines += ["", f"{len(skipped)} kernels could not run their product, e.g. {skipped[0]}"]
    return "\n".join(lines) + "\n"


def plot(rows, path: Path, info) -> None:
    """Each kernel's time over dense's, per problem."""
    plt = benchmark.pyplot()
    by_problem = problems(rows)
    if plt is None or not by_problem:
        return
    keys = list(by_problem)
    impls = [impl for impl, _, _ in PATHS if impl != "dense"]
    fig, ax = plt.subplots(figsize=(max(8, 0.22 * len(keys)), 4.5))
    for impl in impls:
        ax.plot(range(len(keys)), [by_problem[key][0].get(impl, float("nan")) / by_problem[key][0].get("dense", float("nan"))
                                   for key in keys], marker="o", markersize=3, linewidth=1, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(keys)), [f"{m}x{k} N={n} {s}" for m, k, n, s in keys], rotation=90, fontsize=5)
    ax.set_ylabel("time / dense time (below 1: faster)")
    ax.set_title(f"dW over the tile view, {info['gpu']}, {benchmark.short_commit(info, 7)}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
