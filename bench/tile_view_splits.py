"""The grid of the tile-view kernels: each count of blocks per band, forced, against the planner's.

The tile view's SpMM (forward and dX) and SDDMM (dW) split each band of 64 rows (64 columns for dX)
over k blocks; the planner picks k (``tile_view_splits`` in src/spmm/plan.cpp and src/sddmm/plan.cpp).
This times every count in ``--counts`` with the variant forced (``snack.tile_view_splits``), checks
each against a float64 reference, and reports, per problem, the times, the planner's count and the
best one: the evidence for the planners' rules.

    python bench/tile_view_splits.py --dtype bf16
    python bench/tile_view_splits.py --ops dw --counts 1,2,4,8,16,32,64 --tag dw
    python bench/tile_view_splits.py --ops dw --variant tile_view_wgmma --warpgroups 2 --tag dw_wgmma_2

``--variant tile_view_wgmma`` (Hopper, dW only) times the SDDMM's wgmma kernel instead, with
``--warpgroups`` warpgroups a block (0: the planner's). ``--fragments`` (forward only) gives the
forward its tile fragments (``snack.ops.pack_tile_fragments``), so that the fragment kernels run
(``mma.sync`` to 16 rows, ``wgmma`` above on Hopper, ``--warpgroups`` there too):

    python bench/tile_view_splits.py --ops fwd --fragments --ns 256,512 --counts 1,2,3,4 --tag fragments_large

Writes bench/results/tile_view_splits_<gpu>_<dtype>[_<tag>].{csv,md,png}.
"""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch

import snack
from snack import benchmark

try:  # run as a script (python bench/tile_view_splits.py), or imported as bench.tile_view_splits
    from spmm import make_pattern
except ImportError:
    from bench.spmm import make_pattern

SHAPES = [(16384, 4096), (11008, 4096), (4096, 11008), (4096, 4096), (768, 3072), (3072, 768)]
SPARSITIES = [0.8, 0.9, 0.95]
NS = {"fwd": [16, 32, 64, 128], "dx": [1, 8, 16, 64], "dw": [1, 8, 16, 32, 64, 128]}
OP_NAMES = {"fwd": "forward", "dx": "input_grad", "dw": "weight_grad"}
COLUMNS = ["op", "M", "K", "N", "sparsity", "dtype", "splits", "median_us", "planner_splits", "rel_error"]


def bands_of(op: str, m: int, k: int) -> int:
    """Bands of 64 outputs of the product (W's rows; W's columns for dX)."""
    return math.ceil((k if op == "dx" else m) / 64)


def planner_splits(op: str, values, pattern, m: int, k: int, n: int, variant: str = "tile_view",
                   fragments: bool = False) -> int:
    """The planner's blocks per band (per group of bands for the wgmma SDDMM, a band a warpgroup) for
    the forced product, from its grid; `fragments`: the forward given its tile fragments."""
    plan = snack.Plan(*(snack.ops.explain(values, pattern.tensors, n, "forward", "auto", "none", 1, False, True)
                        if fragments else snack.ops.explain(values, pattern.tensors, n, OP_NAMES[op], variant)))
    groups = plan.threads // 128 if variant == "tile_view_wgmma" else 1
    return plan.grid // math.ceil(bands_of(op, m, k) / groups)


def runner(op: str, values, pattern, x, dy, variant: str = "tile_view", fragments=None):
    t = pattern.tensors
    if op == "fwd" and fragments is not None:
        return lambda: snack.ops.spmm(x, values, t, None, tiles=fragments)
    if op == "fwd":
        return lambda: snack.ops.spmm(x, values, t, None, variant="tile_view")
    if op == "dx":
        return lambda: snack.ops.spmm_t(dy, values, t, "tile_view")
    return lambda: snack.ops.sddmm(dy, x, t, variant)


def reference(op: str, w64, pattern, x, dy):
    if op == "fwd":
        return x.double() @ w64.t()
    if op == "dx":
        return dy.double() @ w64
    return (dy.double().t() @ x.double())[pattern.row_idx.long(), pattern.col_idx.long()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="fwd,dx", help="of fwd, dx, dw")
    parser.add_argument("--counts", default="1,2,3,4,6,8", help="blocks per band to force")
    parser.add_argument("--shapes", default=None, help="e.g. 4096x4096,16384x4096")
    parser.add_argument("--sparsities", default=None, help="e.g. 0.9,0.95")
    parser.add_argument("--ns", default=None, help="batch rows for every op (default: per op)")
    parser.add_argument("--variant", choices=["tile_view", "tile_view_wgmma"], default="tile_view",
                        help="the kernel forced (tile_view_wgmma: the SDDMM's, dw only)")
    parser.add_argument("--warpgroups", type=int, choices=[0, 1, 2], default=0,
                        help="tile_view_wgmma's warpgroups a block (0: the planner's)")
    parser.add_argument("--fragments", action="store_true",
                        help="the forward given its tile fragments (the fragment kernels; --ops fwd)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/tile_view_splits.py needs a CUDA GPU")
        return 1
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in NS]
    if unknown:
        parser.error(f"unknown ops {unknown} (expected some of fwd, dx, dw)")
    if args.variant == "tile_view_wgmma" and ops != ["dw"]:
        parser.error("--variant tile_view_wgmma runs dw only")
    if args.fragments and ops != ["fwd"]:
        parser.error("--fragments runs fwd only")
    counts = [int(c) for c in args.counts.split(",")]
    shapes = benchmark.shape_list(args.shapes, SHAPES)
    sparsities = benchmark.number_list(args.sparsities, SPARSITIES, float)
    dtype = benchmark.DTYPES[args.dtype]
    info = benchmark.provenance()
    info["method"] = (f"median of {args.reps} single calls, {benchmark.ColdTimer.METHOD}; {args.dtype}; "
                      + ("the forward given its tile fragments (pack_tile_fragments), the planner's fragment kernel"
                         if args.fragments else f"the variant {args.variant} forced")
                      + ", its blocks per band set with snack.tile_view_splits"
                      + ((f", {args.warpgroups} warpgroups a block" if args.warpgroups else
                          ", the planner's warpgroups a block") + " (snack.fragment_warpgroups)"
                         if args.variant == "tile_view_wgmma" or args.fragments else ""))
    timer = benchmark.ColdTimer()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, failures, skipped = [], [], []
    configs = list(itertools.product(shapes, sparsities))
    for (m, k), sparsity in benchmark.progress(configs, len(configs), "tile_view_splits"):
        pattern = make_pattern(m, k, sparsity, "uniform", gen)
        values = torch.randn(pattern.nnz, device="cuda", generator=gen).to(dtype)
        w64 = torch.zeros(m, k, device="cuda", dtype=torch.float64)
        w64[pattern.row_idx.long(), pattern.col_idx.long()] = values.double()
        fragments = snack.ops.pack_tile_fragments(values, pattern.tensors) if args.fragments else None
        for op in ops:
            for n in benchmark.number_list(args.ns, NS[op]):
                x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
                dy = torch.randn(n, m, device="cuda", generator=gen).to(dtype)
                ref = reference(op, w64, pattern, x, dy)
                with snack.fragment_warpgroups(args.warpgroups):
                    chosen = planner_splits(op, values, pattern, m, k, n, args.variant, args.fragments)
                for count in counts:
                    with snack.tile_view_splits(count), snack.fragment_warpgroups(args.warpgroups):
                        fn = runner(op, values, pattern, x, dy, args.variant, fragments)
                        try:
                            err = benchmark.rel_error(fn(), ref)
                        except ValueError as exc:  # a count this product cannot run
                            skipped.append(f"{op} {m}x{k} N={n} {count}: {exc}")
                            continue
                        if not err < benchmark.TOLERANCE[args.dtype]:
                            failures.append(f"{op} {m}x{k} N={n} s={sparsity} {count} blocks: rel error {err:.2e}")
                            continue
                        us = timer.median_us(fn, reps=args.reps)
                    rows.append(dict(op=op, M=m, K=k, N=n, sparsity=sparsity, dtype=args.dtype, splits=count,
                                     median_us=us, planner_splits=chosen, rel_error=err))
        del w64
    name = f"tile_view_splits_{benchmark.gpu_slug()}_{args.dtype}" + (f"_{args.tag}" if args.tag else "")
    benchmark.write_csv(args.out / f"{name}.csv", info, COLUMNS, rows)
    md = summarize(rows, info, counts, failures, skipped, "tile fragments" if args.fragments else args.variant)
    (args.out / f"{name}.md").write_text(md)
    plot(rows, counts, args.out / f"{name}.png", info, args.variant)
    print(md)
    return 1 if failures else 0


def problems(rows) -> dict:
    """The rows by problem (op, M, K, N, sparsity): {count: time}, and the planner's count."""
    out = {}
    for r in rows:
        key = (r["op"], r["M"], r["K"], r["N"], r["sparsity"])
        out.setdefault(key, ({}, r["planner_splits"]))[0][r["splits"]] = r["median_us"]
    return out


def summarize(rows, info, counts, failures, skipped, variant: str = "tile_view") -> str:
    lines = benchmark.markdown_head(f"Tile-view kernels ({variant}): blocks per band", info)
    lines += ["Times in microseconds per count of blocks per band; `planner` is the planner's count, `best` "
              "the fastest count measured; `planner / best` the planner's time over the best one's (1.00: "
              "the planner took the fastest).", ""]
    by_problem = problems(rows)
    ratios = {}
    head = " | ".join(str(c) for c in counts)
    lines += [f"| op | M x K | N | sparsity | {head} | planner | best | planner / best |",
              "|---|---|---|---|" + "---|" * len(counts) + "---|---|---|"]
    for (op, m, k, n, sparsity), (times, chosen) in by_problem.items():
        best = min(times, key=times.get)
        ratio = times[chosen] / times[best] if chosen in times else float("nan")
        ratios.setdefault(op, []).append(ratio)
        cells = " | ".join(f"{times[c]:.1f}" if c in times else "-" for c in counts)
        lines.append(f"| {op} | {m}x{k} | {n} | {sparsity} | {cells} | {chosen} | {best} | {ratio:.2f} |")
    lines += ["", "## Summary", ""]
    for op, values in ratios.items():
        lines.append(f"- {op}: the planner's count runs {benchmark.geomean(values):.3f}x the best count's time in "
                     f"geometric mean over {len(values)} problems, {max(v for v in values if v == v):.2f}x at worst")
    if failures:
        lines += ["", f"**{len(failures)} runs failed the reference check**, e.g. {failures[0]}"]
    if skipped:
        lines += ["", f"{len(skipped)} counts could not run their product, e.g. {skipped[0]}"]
    return "\n".join(lines) + "\n"


def plot(rows, counts, path: Path, info, variant: str = "tile_view") -> None:
    plt = benchmark.pyplot()
    if plt is None or not rows:
        return
    by_problem = problems(rows)
    keys = list(by_problem)
    grid = [[by_problem[key][0].get(c, float("nan")) / min(by_problem[key][0].values()) for c in counts]
            for key in keys]
    fig, ax = plt.subplots(figsize=(8, max(4, 0.16 * len(keys) + 1.5)))
    image = ax.imshow([[min(v, 2.0) for v in row] for row in grid], aspect="auto", cmap="viridis_r")
    for i, key in enumerate(keys):
        chosen = by_problem[key][1]
        if chosen in counts:
            ax.text(counts.index(chosen), i, "x", ha="center", va="center", color="red", fontsize=7)
    ax.set_xticks(range(len(counts)), [str(c) for c in counts])
    ax.set_xlabel("blocks per band (x: the planner's)")
    ax.set_yticks(range(len(keys)), [f"{op} {m}x{k} N={n} {s}" for op, m, k, n, s in keys], fontsize=5)
    fig.colorbar(image, ax=ax, label="time / best time (capped at 2)")
    ax.set_title(f"{variant} blocks per band, {info['gpu']}, {benchmark.short_commit(info, 7)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
