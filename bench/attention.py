"""Sparse attention against FlexAttention with the same mask and dense causal attention (SDPA).

    python bench/attention.py                         # seq 4k and 16k, head_dim 64/128, 90% and 99% sparse, bf16
    python bench/attention.py --seqs 65536 --sparsities 0.999 --impls snack,sdpa   # the 64k-token row
    python bench/attention.py --impls snack,sdpa --baselines bench/results/attention_nvidia_h200.csv
                                                      # flex's rows taken from an earlier run of the same grid

For each configuration: forward time and forward + backward time (median of CUDA-event timings, L2
flushed before each), and the peak memory of the forward + backward above the inputs. The pattern is
the sparse Transformer example's (causal: each query's nearest three quarters of its keys and a quarter
drawn at random, density 1 - sparsity of the seq x seq matrix); FlexAttention (compiled) runs it as a
block mask over a boolean lookup table, SDPA runs full causal attention (FlashAttention);
snack_no_bands is snack with its 16-bit kernels kept off the tensor-core bands (bands=False).
Writes bench/results/attention_<gpu>.csv (seq, heads, head_dim, sparsity, pattern, dtype, impl,
fwd_us, fwd_bwd_us, peak_mib), .md and a plot.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import snack
from snack import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from sparse_transformer import attention_pattern, flex_block_mask  # noqa: E402  one pattern for both

COLUMNS = ["seq", "heads", "head_dim", "sparsity", "pattern", "dtype", "nnz", "impl", "fwd_us", "fwd_bwd_us",
           "peak_mib"]
IMPLS = ("snack", "snack_no_bands", "flex", "sdpa")


def attention_fn(impl: str, pattern: snack.Pattern, seq: int, device):
    if impl in ("snack", "snack_no_bands"):
        bands = impl == "snack"
        return lambda q, k, v: snack.nn.functional.sparse_attention(q, k, v, pattern, bands=bands)
    if impl == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = flex_block_mask(pattern, seq, device)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def measure(impl, seq, heads, head_dim, sparsity, dtype, timer, reps) -> dict:
    device = torch.device("cuda")
    pattern = attention_pattern(seq, 1.0 - sparsity, device, seed=0)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, generator=gen)
    fn = attention_fn(impl, pattern, seq, device)

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(dout)

    row = dict(seq=seq, heads=heads, head_dim=head_dim, sparsity=sparsity, pattern="causal local+random",
               dtype=str(dtype).removeprefix("torch."), nnz=pattern.nnz, impl=impl)
    try:
        fwd_bwd()  # compiles FlexAttention's kernels before memory is measured
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        torch.cuda.synchronize()
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["fwd_us"] = timer.median_us(fwd, reps=reps)
        row["fwd_bwd_us"] = timer.median_us(fwd_bwd, reps=reps)
    except torch.cuda.OutOfMemoryError:
        row.update(fwd_us=math.nan, fwd_bwd_us=math.nan, peak_mib=math.nan)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="4096,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--sparsities", default="0.9,0.99")
    parser.add_argument("--dtype", default="bf16", choices=sorted(benchmark.DTYPES))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--baselines", type=Path, default=None,
                        help="a result CSV of an earlier run: its rows of the impls not measured now (FlexAttention, "
                             "whose compilation takes most of a sweep) are reported beside the new ones, and the "
                             "header says where they come from")
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU")
        return 1
    impls = args.impls.split(",")
    if any(i not in IMPLS for i in impls):
        raise SystemExit(f"--impls from {IMPLS}")
    dtype = benchmark.DTYPES[args.dtype]
    grid = [(s, d, sp, impl) for s in map(int, args.seqs.split(",")) for d in map(int, args.head_dims.split(","))
            for sp in map(float, args.sparsities.split(",")) for impl in impls]
    timer = benchmark.ColdTimer()
    info = benchmark.provenance()
    info["method"] = benchmark.ColdTimer.METHOD + f"; median of {args.reps}; batch 1, {args.heads} heads"
    stem = args.out / f"attention_{benchmark.gpu_slug()}{'_' + args.tag if args.tag else ''}"
    rows = []
    if args.baselines is not None:
        rows, info["baselines"] = _baseline_rows(args.baselines, grid, set(impls), info["gpu"])
        impls = impls + sorted({r["impl"] for r in rows})
    for seq, head_dim, sparsity, impl in benchmark.progress(grid, len(grid), "attention"):
        row = measure(impl, seq, args.heads, head_dim, sparsity, dtype, timer, args.reps)
        rows.append(row)
        print(f"seq {seq:>6} d {head_dim:>3} {sparsity:g} {impl:<6}: fwd {row['fwd_us']:10.1f} us, fwd+bwd "
              f"{row['fwd_bwd_us']:10.1f} us, peak {row['peak_mib']:8.1f} MiB", flush=True)
        if impl == "flex":
            torch.compiler.reset()  # each configuration compiles its own kernels
        # The files so far after every row: a sweep stopped part-way keeps what it measured.
        benchmark.write_csv(stem.with_suffix(".csv"), info, COLUMNS, rows)
        _report(stem, rows, info, impls, plot=False)
    _report(stem, rows, info, impls)
    print(f"wrote {stem}.csv, .md, .png")
    return 0


def _baseline_rows(path: Path, grid, measured: set, gpu: str) -> tuple[list[dict], str]:
    """The rows of an earlier result file for this grid's configurations and the impls not measured
    now, and a line saying where they come from; the file must come from this GPU (`gpu`)."""
    old_info, old_rows = benchmark.read_csv(path, int_columns=("seq", "heads", "head_dim", "nnz"))
    if old_info.get("gpu") != gpu:
        raise SystemExit(f"--baselines {path}: measured on {old_info.get('gpu', 'an unnamed GPU')}, not on this "
                         f"{gpu}; its times are no baseline here")
    configs = {(seq, d, sp) for seq, d, sp, _ in grid}
    rows = [r for r in old_rows if r["impl"] not in measured and (r["seq"], r["head_dim"], r["sparsity"]) in configs]
    if "baselines" in old_info:  # that file's rows were themselves taken from an earlier one
        return rows, old_info["baselines"]
    impls = ", ".join(sorted({r["impl"] for r in rows})) or "none"
    return rows, (f"{impls} rows from {path.name}, measured at commit {old_info.get('commit', '?')[:10]} on "
                  f"{old_info.get('date', '?')} ({old_info.get('gpu', '?')}, torch {old_info.get('torch', '?')})")


def _report(stem: Path, rows, info, impls, plot: bool = True) -> None:
    lines = benchmark.markdown_head("Sparse attention", info)
    lines += ["Times in us; `x flex` / `x sdpa`: a snack row's speed-up over that impl (> 1: snack faster); peak: "
              "MiB above the inputs during forward + backward.", "",
              "| seq | head_dim | sparsity | impl | fwd us | fwd+bwd us | peak MiB | fwd x flex | fwd+bwd x flex | "
              "fwd x sdpa | fwd+bwd x sdpa |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["seq"], r["head_dim"], r["sparsity"], r["impl"]): r for r in rows}
    order = {impl: n for n, impl in enumerate(IMPLS)}
    for r in sorted(rows, key=lambda r: (r["seq"], r["head_dim"], r["sparsity"], order.get(r["impl"], len(order)))):
        ratios = []
        for base in ("flex", "sdpa"):
            other = by_key.get((r["seq"], r["head_dim"], r["sparsity"], base))
            for column in ("fwd_us", "fwd_bwd_us"):
                ratios.append(f"{other[column] / r[column]:.2f}" if other and r["impl"].startswith("snack") else "")
        lines.append(f"| {r['seq']} | {r['head_dim']} | {r['sparsity']:g} | {r['impl']} | {r['fwd_us']:.1f} | "
                     f"{r['fwd_bwd_us']:.1f} | {r['peak_mib']:.1f} | " + " | ".join(ratios) + " |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = benchmark.pyplot() if plot else None
    if plt is None:
        return
    keys = sorted({(r["head_dim"], r["sparsity"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, (d, sp) in zip(axes[0], keys):
        for impl in impls:
            mine = [r for r in rows if r["impl"] == impl and r["head_dim"] == d and r["sparsity"] == sp]
            ax.plot([r["seq"] for r in mine], [r["fwd_bwd_us"] for r in mine], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"head_dim {d}, sparsity {sp:g}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("forward + backward us")
        ax.legend()
    fig.suptitle(f"Sparse attention ({rows[0]['dtype']}) - {info['gpu']}, commit {benchmark.short_commit(info)}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
