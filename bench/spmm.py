"""Forward SpMM benchmark: snack against dense, Dense+Mask and cuSPARSE (through torch.sparse).

    python bench/spmm.py                 # the full grid of the issue (about 10 minutes on an H200)
    python bench/spmm.py --quick         # a few rows, to check the set-up
    python bench/spmm.py --variants      # also each snack kernel variant, forced (impl snack_<variant>)
    python bench/spmm.py --variants dense_blocks,global_xt   # ... or the variants named
                                         # (tile_view in 16 bits adds snack_tile_view_packed and
                                         # snack_tile_view_fragments, snack_tile_view_bitmaps: its
                                         # kernels reading packed tile values, tile fragments or bitmap
                                         # fragments, snack.ops.pack_tile_values / pack_tile_fragments /
                                         # pack_tile_bitmaps; wgmma adds snack_wgmma_fragments,
                                         # snack_wgmma_bitmaps and snack_wgmma_fragments_packed, packed
                                         # in the call; 16 bits also times snack_packed,
                                         # snack_fragments and snack_bitmaps, the planner given them)
    python bench/spmm.py --dtype bf16    # bf16 (or fp16) values and activations: spmm_<gpu>_bf16.*
    python bench/spmm.py --large         # training batches, N = 256-16384: spmm_<gpu>[_bf16]_large.*

Every implementation gets the same inputs in one process; each result is checked against a float64
reference before it is timed; times are medians of CUDA-event timings of single calls with a cold L2
(2x L2 written between calls). Writes bench/results/spmm_<gpu>.csv, .md and .png.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

import snack
from snack import benchmark

SHAPES = [(768, 3072), (3072, 768), (4096, 4096), (5000, 5000), (16384, 4096)]
NS = [1, 8, 16, 32, 128]
SPARSITIES = [0.8, 0.9, 0.95, 0.99]
# --large: the training batches of a layer (GPT-2 small at 8 x 1024 tokens is N = 8192).
LARGE_SHAPES = [(768, 3072), (3072, 768), (4096, 4096), (16384, 4096)]
LARGE_NS = [256, 1024, 4096, 16384]
PATTERNS = ["uniform", "powerlaw"]
BASELINES = ["dense", "dense_mask", "cusparse_csr", "cusparse_coo"]
COLUMNS = ["op", "M", "K", "N", "sparsity", "pattern", "dtype", "impl", "median_us", "floor_us", "tflops"]


def make_pattern(m: int, k: int, sparsity: float, pattern: str, gen: torch.Generator) -> snack.Pattern:
    """The snack.Pattern of a benchmark: uniform or power-law row lengths."""
    density = 1.0 - sparsity
    if pattern == "uniform":
        return snack.Pattern.random(m, k, snack.nnz_for_density(m, k, density), generator=gen, device="cuda")
    # Power-law row lengths (a few very long rows, many short ones), same expected nnz.
    ranks = torch.randperm(m, generator=gen, device="cuda").double() + 1
    weight = ranks.pow(-0.8)
    p = torch.clamp(weight * (density * m / weight.sum()), max=1.0)
    for _ in range(20):  # rescale the uncapped rows so the total stays at density * m * k
        deficit = density * m - p.sum()
        free = p < 1.0
        if deficit.abs() < 1e-6 or not free.any():
            break
        p[free] = torch.clamp(p[free] * (1 + deficit / p[free].sum()), max=1.0)
    mask = torch.rand(m, k, generator=gen, device="cuda", dtype=torch.float32) < p[:, None].float()
    return snack.Pattern.from_mask(mask)[0]


def floor_us(m: int, k: int, n: int, nnz: int, bandwidth_gbs: float, value_bytes: int = 4) -> float:
    """Fewest bytes of the forward with CSR and 32-bit indices (values, column indices, row pointers,
    X, Y) over bandwidth; values and activations of `value_bytes` bytes."""
    nbytes = nnz * (value_bytes + 4) + 4 * (m + 1) + value_bytes * (n * k + n * m)
    return nbytes / (bandwidth_gbs * 1e9) * 1e6


def build_impls(pattern: snack.Pattern, values, dense_w, mask, x, variants=()):
    m, k = dense_w.shape
    tensors = pattern.tensors
    csr = torch.sparse_csr_tensor(pattern.row_ptr, pattern.col_idx.int(), values, (m, k))
    coo = torch.sparse_coo_tensor(torch.stack([pattern.row_idx.long(), pattern.col_idx.long()]), values,
                                  (m, k)).coalesce()
    xt = x.t()
    impls = {
        "snack": lambda: snack.ops.spmm(x, values, tensors, None),
        "dense": lambda: x @ dense_w.t(),
        "dense_mask": lambda: x @ (dense_w * mask).t(),
        "cusparse_csr": lambda: torch.sparse.mm(csr, xt).t(),
        "cusparse_coo": lambda: torch.sparse.mm(coo, xt).t(),
    }
    for v in variants:
        impls[f"snack_{v}"] = (lambda v: lambda: snack.ops.spmm(x, values, tensors, None, variant=v))(v)
    if values.dtype in (torch.bfloat16, torch.float16) and pattern.has_tile_view:
        # Given the values in tile order (packed once, untimed): the values packed into the view's
        # entries or laid out as tile fragments, the planner's choice then (snack_packed,
        # snack_fragments, snack_bitmaps for the bitmap fragments), and the tile view's kernels reading
        # them (snack_tile_view_packed, snack_tile_view_fragments, snack_tile_view_bitmaps) and wgmma's
        # reading either fragments (snack_wgmma_fragments, snack_wgmma_bitmaps; with one or two consumer
        # warpgroups forced: snack_wgmma_fragments_1group, snack_wgmma_fragments_2groups).
        for name, pack in (("packed", snack.ops.pack_tile_values), ("fragments", snack.ops.pack_tile_fragments),
                           ("bitmaps", snack.ops.pack_tile_bitmaps)):
            tiles = pack(values, tensors)
            impls[f"snack_{name}"] = (lambda t: lambda: snack.ops.spmm(x, values, tensors, None, tiles=t))(tiles)
            for v in ("tile_view", "wgmma"):  # wgmma reads the fragments only
                if v in variants and (v == "tile_view" or name != "packed"):
                    impls[f"snack_{v}_{name}"] = (lambda t, v: lambda: snack.ops.spmm(
                        x, values, tensors, None, variant=v, tiles=t))(tiles, v)
            if "wgmma" in variants and name == "fragments":
                # ... and with the fragments packed inside the timed call, as a plan that packs them
                # for one product runs (snack_wgmma_fragments_packed): where packing per product pays.
                impls["snack_wgmma_fragments_packed"] = lambda: snack.ops.spmm(
                    x, values, tensors, None, variant="wgmma", tiles=snack.ops.pack_tile_fragments(values, tensors))
                for groups, label in ((1, "1group"), (2, "2groups")):
                    impls[f"snack_wgmma_fragments_{label}"] = (lambda t, g: lambda: _with_warpgroups(
                        g, lambda: snack.ops.spmm(x, values, tensors, None, variant="wgmma", tiles=t)))(tiles, groups)
    return impls


def _with_warpgroups(groups: int, run):
    with snack.fragment_warpgroups(groups):
        return run()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small subset of the grid")
    parser.add_argument("--variants", nargs="?", const="all", default=None,
                        help="also time every snack kernel variant, or those named (comma-separated)")
    parser.add_argument("--large", action="store_true", help="the training-batch grid (N = 256-16384)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    parser.add_argument("--shapes", default=None, help="e.g. 4096x4096,16384x4096")
    parser.add_argument("--ns", default=None, help="e.g. 1,16")
    parser.add_argument("--sparsities", default=None, help="e.g. 0.9,0.99")
    parser.add_argument("--patterns", default=None, help="uniform,powerlaw")
    parser.add_argument("--impls", default=None, help="subset of implementations to time")
    parser.add_argument("--dtype", choices=sorted(benchmark.DTYPES), default="fp32", help="values and activations")
    parser.add_argument("--tag", default="", help="suffix of the result files (spmm_<gpu>_<dtype>_<tag>.*)")
    parser.add_argument("--render", action="store_true",
                        help="only rebuild the .md and .png from the spmm_<gpu>*.csv result files in --out")
    args = parser.parse_args(argv)
    if args.render:
        return render(args.out)
    dtype = benchmark.DTYPES[args.dtype]
    if not torch.cuda.is_available():
        print("bench/spmm.py needs a CUDA GPU")
        return 1

    shapes = benchmark.shape_list(args.shapes, SHAPES)
    ns = benchmark.number_list(args.ns, NS)
    sparsities = benchmark.number_list(args.sparsities, SPARSITIES, float)
    patterns = args.patterns.split(",") if args.patterns else PATTERNS
    if args.large:
        shapes = LARGE_SHAPES if not args.shapes else shapes
        ns = LARGE_NS if not args.ns else ns
    if args.quick:
        shapes, ns, sparsities, patterns = [(4096, 4096), (16384, 4096)], [1, 16, 128], [0.9, 0.99], ["uniform"]
    variants = () if args.variants is None else (
        snack.SPMM_VARIANTS if args.variants == "all" else tuple(args.variants.split(",")))
    unknown = [v for v in variants if v not in snack.SPMM_VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown} (expected some of {', '.join(snack.SPMM_VARIANTS)})")

    torch.backends.cuda.matmul.allow_tf32 = False
    info = benchmark.provenance()
    bandwidth = benchmark.copy_bandwidth_gbs()
    info["copy_bandwidth"] = f"{bandwidth:.0f} GB/s (device-to-device copy, read+write, measured in this run)"
    info["method"] = f"median of {args.reps} single calls, {benchmark.ColdTimer.METHOD}; {args.dtype}"
    timer = benchmark.ColdTimer()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out, failures, skipped = [], [], []
    slug = benchmark.gpu_slug()
    suffix = (("" if args.dtype == "fp32" else f"_{args.dtype}") + ("_large" if args.large else "") +
              ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else ""))
    csv_path = args.out / f"spmm_{slug}{suffix}.csv"
    configs = list(itertools.product(shapes, sparsities, patterns))
    for (m, k), sparsity, pattern in benchmark.progress(configs, len(configs), "spmm"):
        pat = make_pattern(m, k, sparsity, pattern, gen)
        nnz = pat.nnz
        values = torch.randn(nnz, device="cuda", generator=gen).to(dtype)
        dense_w = torch.zeros(m, k, device="cuda", dtype=dtype)
        dense_w[pat.row_idx.long(), pat.col_idx.long()] = values
        mask = (dense_w != 0).to(dtype)
        w64 = dense_w.double()
        for n in ns:
            x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
            ref = x.double() @ w64.t()
            impls = build_impls(pat, values, dense_w, mask, x, variants)
            if args.impls:
                impls = {k_: v for k_, v in impls.items() if k_ in args.impls.split(",")}
            fl = floor_us(m, k, n, nnz, bandwidth, dtype.itemsize)
            for name, fn in impls.items():
                try:
                    err = benchmark.rel_error(fn(), ref)
                except ValueError as exc:  # a forced variant that cannot run this shape
                    skipped.append(f"{name} {m}x{k} N={n}: {exc}")
                    continue
                except RuntimeError as exc:  # a baseline without this dtype; snack's own errors stay errors
                    if name not in BASELINES:
                        raise
                    skipped.append(f"{name} {m}x{k} N={n}: {exc}")
                    continue
                if not err < benchmark.TOLERANCE[args.dtype]:
                    failures.append(f"{name} {m}x{k} N={n} s={sparsity} {pattern}: rel error {err:.2e}")
                    continue
                us = timer.median_us(fn, reps=args.reps)
                rows_out.append(dict(op="fwd", M=m, K=k, N=n, sparsity=sparsity, pattern=pattern, dtype=args.dtype,
                                     impl=name, median_us=us, floor_us=fl, tflops=benchmark.useful_tflops(nnz, n, us)))
        del dense_w, mask, w64
        benchmark.write_csv(csv_path, info, COLUMNS, rows_out)  # after every configuration: a cut-off run keeps its rows
    md = summarize(rows_out, info, failures, args.dtype)
    if skipped:
        md += f"\n{len(skipped)} runs were not possible (a forced variant's shared memory, or a baseline without {args.dtype}), e.g. {skipped[0]}\n"
    (args.out / f"spmm_{slug}{suffix}.md").write_text(md)
    plot(rows_out, args.out / f"spmm_{slug}{suffix}.png", info, args.dtype)
    print(md)
    print(f"wrote {csv_path}")
    return 1 if failures else 0


def render(out: Path) -> int:
    """Rebuilds the Markdown summary and the plot of every spmm_*.csv in `out` (no GPU needed)."""
    paths = sorted(out.glob("spmm_*.csv"))
    for csv_path in paths:
        info, rows = benchmark.read_csv(csv_path)
        if not rows:
            continue
        dtype = str(rows[0]["dtype"])
        info = dict(info, rendered=f"rebuilt from {csv_path.name} by `bench/spmm.py --render` at commit "
                                   f"{benchmark.git_commit()[:7]} (the CSV's 4 significant digits)")
        md = summarize(rows, info, [], dtype)
        csv_path.with_suffix(".md").write_text(md)
        plot(rows, csv_path.with_suffix(".png"), info, dtype)
        print(f"rebuilt {csv_path.with_suffix('.md')} and .png")
    return 0 if paths else 1


def floor_evidence(t, keys, info, primary: str = "snack", dtype: str = "fp32") -> list[str]:
    """Why the floor target is missed, row by row: what 60% of the floor needs, and the effective
    bandwidth of the fewest bytes (floor / time x the measured copy bandwidth)."""
    bandwidth = float(info.get("copy_bandwidth", "nan").split()[0])
    lines = ["", "### The floor target, row by row (16384x4096, N <= 16)", "",
             "| N | sparsity | floor us | snack us | % of floor | 60% needs us | effective GB/s |",
             "|---|---|---|---|---|---|---|"]
    for k in keys:
        r = t[k + (primary,)]
        share = r["floor_us"] / r["median_us"]
        lines.append(f"| {k[2]} | {k[3]} | {r['floor_us']:.1f} | {r['median_us']:.1f} | {100 * share:.0f}% | "
                     f"{r['floor_us'] / 0.6:.1f} | {share * bandwidth:.0f} |")
    sparse = [t[k + (primary,)]["floor_us"] for k in keys if k[3] >= 0.99]
    at_99 = f" ({min(sparse):.1f}-{max(sparse):.1f} us here)" if sparse else ""
    if dtype != "fp32" and primary != "snack_fragments":
        return lines + ["", "Why: `docs/kernels.md`, \"Where the targets stand\" (16-bit values without tile fragments "
                        "given, the planner's CUDA-core and tile-view kernels)."]
    if dtype != "fp32":
        return lines + ["", "Why (the analysis and its evidence: `docs/kernels.md`, \"Tile fragments\", \"What bounds "
                        "it\"): up to 16 rows the planner reads tile fragments with `mma.sync`, whose time hardly "
                        "follows the sparsity. On 16384x4096 at N = 16 its skeleton alone (the stages' barriers, "
                        "nothing copied or multiplied) takes over half of it, ~0.24 us a step and ~9.5 us of launch, "
                        "prologue and epilogue under this timer; the copies add ~10 us at 90%, the products ~3. "
                        "More stages, fewer copies and fewer barrier round trips were each measured and ruled out."]
    lines += ["", "Why (the analysis and its evidence: `docs/kernels.md`, \"What bounds the forward\", "
              "and Nsight Compute on the H200 in `spmm_ncu_nvidia_h200.txt`): from N = 8 the kernel is bound by "
              "the L1 gathers of X^T, one L1 wavefront per entry (on the H200: L1 ~85% busy, DRAM ~15%); at N = 1 "
              "the wide_rows kernel (16-byte loads of W's slots, X's row in shared memory) is still bound by "
              "latency at half occupancy (DRAM ~49% busy at 90%), and at 95% its groups are short (4 rows of "
              "~205 slots), so its fixed costs (staging X, the row pointers) weigh more; at 99% the floor"
              f"{at_99} is below the cost of one launch under this timer (~4-5 us on the H200). X^T staged "
              "in shared memory by column blocks (the tiled view, measured and not kept) made the "
              "gathers cheaper but was slower overall (16384x4096, 90%, N = 16: 61.8 against 55.3 us): the "
              "warps then wait on the stream of W, and the staging adds ~3-4 us per column block. wide_rows "
              "with the batch in shared memory (`spmm_wide_rows_ncu_nvidia_h200.txt`) streams W as at "
              "N = 1 (N = 4, 90%: 23.2 us), but a tile of 8 fp32 rows gathers 32 random bytes per slot, and "
              "shared memory serves them at 5.4-way bank conflicts (16384x4096, 90%, N = 8: 40.7 us against "
              "39.4 us for global_xt): in fp32, N = 8-16 is bound by the bytes of X gathered per entry, through "
              "L1 or shared memory alike. What is left there: fewer gathered bytes per entry (16-bit "
              "activations: bf16 at N = 8, 25.9 us) or gathers shared between entries of one column."]
    return lines


def index(rows):
    table = {}
    for r in rows:
        table[(r["M"], r["K"], r["N"], r["sparsity"], r["pattern"], r["impl"])] = r
    return table


def tflops(row) -> str:
    """The row's useful TFLOP/s, "-" in result files written before the column."""
    value = row.get("tflops")
    return "-" if value in (None, "") else f"{float(value):.2f}"


def planner_impl(rows) -> str:
    """The impl that stands for snack in the summary: the planner's choice (`snack`), or where a run
    left it out (--impls), the planner given tile fragments or packed tile values."""
    present = {r["impl"] for r in rows}
    return next((i for i in ("snack", "snack_fragments", "snack_packed") if i in present), "snack")


def summarize(rows, info, failures, dtype: str = "fp32") -> str:
    t = index(rows)
    primary = planner_impl(rows)
    keys = sorted({(r["M"], r["K"], r["N"], r["sparsity"], r["pattern"]) for r in rows},
                  key=lambda c: (c[4], c[0] * c[1], c[0], c[3], c[2]))
    impls = [primary] + [b for b in BASELINES]
    lines = benchmark.markdown_head("Forward SpMM benchmark", info)
    lines += [f"Median microseconds (cold L2); snack is `{primary}`. `%floor` = floor / snack time. Speedups are baseline time / snack time. "
              "TFLOP/s: snack's useful work, 2 x nnz x N flops over its time.", ""]
    lines.append("| M x K | N | sparsity | pattern | floor | " + " | ".join(impls) +
                 " | %floor | TFLOP/s | vs dense | vs D+M | vs csr |")
    lines.append("|" + "---|" * (4 + 1 + len(impls) + 5))
    for key in keys:
        cells = [t.get(key + (i,)) for i in impls]
        snack_row = t.get(key + (primary,))
        if snack_row is None:
            continue
        s = snack_row["median_us"]

        def ratio(name):
            r = t.get(key + (name,))
            return f"{r['median_us'] / s:.2f}x" if r else "-"

        lines.append(f"| {key[0]}x{key[1]} | {key[2]} | {key[3]} | {key[4]} | {snack_row['floor_us']:.1f} | " +
                     " | ".join(f"{c['median_us']:.1f}" if c else "-" for c in cells) +
                     f" | {100 * snack_row['floor_us'] / s:.0f}% | {tflops(snack_row)} | {ratio('dense')} | {ratio('dense_mask')} | "
                     f"{ratio('cusparse_csr')} |")
    lines += ["", f"## Targets ({dtype}, uniform pattern, sparsity 0.9-0.99; the issue sets them for fp32)", ""]
    target_keys = [k for k in keys if k[4] == "uniform" and k[3] >= 0.9 and (k + (primary,)) in t]

    def speedups(base):
        return [t[k + (base,)]["median_us"] / t[k + (primary,)]["median_us"] for k in target_keys if (k + (base,)) in t]

    g_csr, g_dm = benchmark.geomean(speedups("cusparse_csr")), benchmark.geomean(speedups("dense_mask"))
    vs_dense = speedups("dense")
    slower = [k for k in target_keys if (k + ("dense",)) in t and
              t[k + (primary,)]["median_us"] > t[k + ("dense",)]["median_us"]]
    big = [k for k in target_keys if k[0] == 16384 and k[1] == 4096 and k[2] <= 16]
    floors = [t[k + (primary,)]["floor_us"] / t[k + (primary,)]["median_us"] for k in big]
    for base, g, target in (("cusparse_csr", g_csr, 3), ("dense_mask", g_dm, 5)):
        if speedups(base):
            lines.append(f"- geomean speedup over {base}: **{g:.2f}x** (target >= {target}x) "
                         f"{'met' if g >= target else 'MISSED'}")
        else:
            lines.append(f"- geomean speedup over {base}: not measured in this run (target >= {target}x)")
    lines.append(f"- slower than dense in {len(slower)} of {len(vs_dense)} rows (target: none) "
                 f"{'met' if not slower else 'MISSED: ' + ', '.join(f'{k[0]}x{k[1]} N={k[2]} s={k[3]}' for k in slower)}")
    held = [k for k in keys if k[3] >= 0.8 and (k + ("dense",)) in t and (k + (primary,)) in t]
    below = [k for k in held if t[k + (primary,)]["median_us"] > t[k + ("dense",)]["median_us"] / 0.9]
    lines.append(f"- at least 0.9x dense's speed at sparsity >= 0.8 in {len(held) - len(below)} of {len(held)} rows "
                 f"(target: all) {'met' if not below else 'MISSED: ' + ', '.join(f'{k[0]}x{k[1]} N={k[2]} s={k[3]} {k[4]}' for k in below)}")
    if floors:
        lines.append(f"- % of floor on 16384x4096, N <= 16: min {100 * min(floors):.0f}%, "
                     f"max {100 * max(floors):.0f}% (target >= 60%) {'met' if min(floors) >= 0.6 else 'MISSED'}")
        if min(floors) < 0.6:
            lines += floor_evidence(t, big, info, primary, dtype)
    lines += variant_table(rows, t, keys, primary)
    if failures:
        lines += ["", "## Correctness failures (not timed)", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def variant_table(rows, t, keys, primary: str = "snack") -> list[str]:
    """Each forced variant's time beside the planner's choice (`primary`) and dense: checks the choice."""
    variants = sorted({r["impl"][len("snack_"):] for r in rows if r["impl"].startswith("snack_") and r["impl"] != primary})
    if not variants:
        return []
    lines = ["", f"## Each variant, forced (median us); `snack` is the planner's choice (`{primary}`)", "",
             "| M x K | N | sparsity | pattern | snack | " + " | ".join(variants) + " | dense | choice / best |",
             "|" + "---|" * (6 + len(variants) + 1)]
    for key in keys:
        if (key + (primary,)) not in t:
            continue
        times = {v: t[key + (f"snack_{v}",)]["median_us"] for v in variants if (key + (f"snack_{v}",)) in t}
        best = min(times.values()) if times else float("nan")
        dense = t.get(key + ("dense",))
        chosen = t[key + (primary,)]["median_us"]
        cells = [f"{times[v]:.1f}" if v in times else "-" for v in variants]
        cells.append(f"{dense['median_us']:.1f}" if dense else "-")
        cells.append(f"{chosen / best:.2f}" if times else "-")
        lines.append(f"| {key[0]}x{key[1]} | {key[2]} | {key[3]} | {key[4]} | {chosen:.1f} | " + " | ".join(cells) + " |")
    return lines


def plot(rows, path: Path, info, dtype: str = "fp32") -> None:
    plt = benchmark.pyplot()
    if plt is None:
        print("matplotlib missing: no plot")
        return
    t = index(rows)
    present = {r["impl"] for r in rows}
    # Two of the baselines a run timed (--impls may leave some out); the planner given packed tile
    # values (snack_packed, dashed) or tile fragments (snack_fragments, dotted) beside its choice
    # without them.
    bases = [b for b in ("dense_mask", "cusparse_csr", "dense") if b in present][:2] or ["dense"]
    fig, axes = plt.subplots(1, len(bases), figsize=(max(9, 6 * len(bases)), 4.5), squeeze=False)
    for ax, base in zip(axes[0], bases):
        for i, n in enumerate(sorted({r["N"] for r in rows})):
            for impl, style in (("snack", "-"), ("snack_packed", "--"), ("snack_fragments", ":")):
                if impl not in present:
                    continue
                xs, ys = [], []
                for s in sorted({r["sparsity"] for r in rows}):
                    keys = [k for k in t if k[2] == n and k[3] == s and k[4] == "uniform" and k[5] == impl]
                    sp = [t[k[:5] + (base,)]["median_us"] / t[k]["median_us"] for k in keys if (k[:5] + (base,)) in t]
                    if sp:
                        xs.append(s)
                        ys.append(benchmark.geomean(sp))
                ax.plot(xs, ys, marker="o", linestyle=style, color=f"C{i}",
                        label=f"N={n}" + {"snack_packed": ", packed tiles", "snack_fragments": ", fragments"}.get(impl, ""))
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("sparsity")
        ax.set_ylabel(f"speedup of snack over {base} (geomean over shapes)")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"snack forward SpMM, {dtype}, uniform pattern - {info['gpu']}, commit {benchmark.short_commit(info)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
