"""Time of one topology update of a SparseLinear: prune + regrow a fraction of the connections,
rebuild the CSR/CSC views, move and reset AdamW state (the whole `DSTScheduler` update of one layer).

    python bench/dst.py      # 4096x4096 and 16384x4096 at 90% sparsity, 30% moved, SET and RigL
    python bench/dst.py --batches 16,8192 --dtypes fp32,bf16   # RigL's scores from N rows of X and dY
                                                               # (bf16: the 16-bit operands of autocast)

GPU time with CUDA events around the update (median of several updates on fresh layers).
Writes bench/results/dst_<gpu>.csv (M,K,N,dtype,sparsity,fraction,algorithm,update_us) and .md.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import snack
from snack import benchmark

COLUMNS = ["M", "K", "N", "dtype", "sparsity", "fraction", "algorithm", "update_us"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fresh_layer(m, k, sparsity, seed, n=16, dtype=torch.float32):
    """A layer after one AdamW step (so the optimizer has state to move), an input and an output
    gradient of n rows in `dtype` (RigL's operands; the layer's values stay float32, as under autocast)."""
    layer = snack.SparseLinear(k, m, sparsity=sparsity, device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(seed))
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    x = torch.randn(n, k, device="cuda")
    layer(x).square().mean().backward()
    opt.step()
    return layer, opt, x.to(dtype), torch.randn(n, m, device="cuda").to(dtype)


RULES = {"set": snack.dst.SET, "rigl": snack.dst.RigL}


def update(layer, opt, x, dy, n_move, algorithm, gen):
    """What DSTScheduler does for one layer with its SET or RigL rule (trusted: validate=False)."""
    rule = RULES[algorithm]()
    drop = rule.prune(layer, n_move)
    grow = rule.grow(layer, n_move, generator=gen, x=x, dy=dy)
    layer.update_topology(drop, grow, optimizer=opt, validate=False)


def one_update_us(m, k, sparsity, fraction, algorithm, reps=5, n=16, dtype=torch.float32):
    times = []
    for rep in range(reps + 1):
        layer, opt, x, dy = fresh_layer(m, k, sparsity, rep, n, dtype)
        gen = torch.Generator(device="cuda").manual_seed(rep)
        n_move = int(fraction * layer.nnz)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # The warm-up update runs with synchronising CUDA calls turned into errors: the proof that
        # the timed path never waits for the GPU.
        torch.cuda.set_sync_debug_mode("error" if rep == 0 else "default")
        try:
            start.record()
            update(layer, opt, x, dy, n_move, algorithm, gen)
            end.record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        end.synchronize()
        if rep > 0:  # the first one pays for allocator warm-up
            times.append(start.elapsed_time(end) * 1e3)
        del layer, opt
    return statistics.median(times)


def profile_update(m, k, sparsity, fraction, algorithm) -> str:
    """torch.profiler over one update (after a warm-up one): where the time goes, op by op."""
    from torch.profiler import ProfilerActivity, profile

    warm = fresh_layer(m, k, sparsity, 0)
    update(*warm, int(fraction * warm[0].nnz), algorithm, torch.Generator(device="cuda").manual_seed(0))
    del warm
    layer, opt, x, dy = fresh_layer(m, k, sparsity, 1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    n_move = int(fraction * layer.nnz)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        update(layer, opt, x, dy, n_move, algorithm, gen)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events)
    return (f"== {m}x{k} {sparsity:g} moved {fraction:g} {algorithm}: GPU kernel time {kernel_us:.0f} us "
            "(sum of self device times)\n"
            + events.table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=60))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR, help="results folder")
    parser.add_argument("--reps", type=int, default=5, help="updates timed per configuration")
    parser.add_argument("--profile", action="store_true",
                        help="also write dst_profile_<gpu>.txt: torch.profiler tables of one update at 16384x4096")
    parser.add_argument("--batches", default="16", help="rows N of RigL's X and dY (comma-separated)")
    parser.add_argument("--dtypes", default="fp32", help="dtype of RigL's X and dY: fp32, bf16, fp16 (comma-separated)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    if any(d not in DTYPES for d in dtypes) or any(b < 1 for b in batches):
        raise SystemExit(f"--dtypes takes {', '.join(DTYPES)}; --batches positive integers")
    if not torch.cuda.is_available():
        print("bench/dst.py needs a CUDA GPU")
        return 1
    info = benchmark.provenance()
    info["method"] = f"median of {args.reps} updates on fresh layers, CUDA events around prune + grow + update_topology"
    rows = []
    for (m, k) in [(4096, 4096), (16384, 4096)]:
        for algorithm in ("set", "rigl"):
            # SET draws no scores: one row; RigL one per batch and dtype of its operands.
            for n, dtype in ([(batches[0], dtypes[0])] if algorithm == "set" else
                             [(n, d) for n in batches for d in dtypes]):
                us = one_update_us(m, k, 0.9, 0.3, algorithm, reps=args.reps, n=n, dtype=DTYPES[dtype])
                rows.append(dict(M=m, K=k, N=n, dtype=dtype, sparsity=0.9, fraction=0.3, algorithm=algorithm,
                                 update_us=us))
                print(f"{m}x{k} 90% 30% {algorithm} N={n} {dtype}: {us:.0f} us")
    slug = benchmark.gpu_slug()
    benchmark.write_csv(args.out / f"dst_{slug}.csv", info, COLUMNS, rows)
    lines = benchmark.markdown_head("Topology update time", info)
    lines += ["| M x K | N | dtype | sparsity | moved | algorithm | update us |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['M']}x{r['K']} | {r['N']} | {r['dtype']} | {r['sparsity']} | {r['fraction']} | {r['algorithm']} | "
              f"{r['update_us']:.0f} |" for r in rows]
    target = [r for r in rows if r["M"] == 16384 and r["N"] <= 256]
    lines += ["", "- target: < 2000 us for 16384x4096 with no host synchronisation inside; measured "
              + ", ".join(f"{r['algorithm']} (N = {r['N']}, {r['dtype']}) {r['update_us']:.0f} us" for r in target)
              + " (each configuration's first update ran under torch.cuda.set_sync_debug_mode('error'), which raises on "
              "any host synchronisation; timing ends with an event)"]
    (args.out / f"dst_{slug}.md").write_text("\n".join(lines) + "\n")
    if args.profile:
        text = "\n".join(profile_update(16384, 4096, 0.9, 0.3, a) for a in ("set", "rigl"))
        benchmark.write_text(args.out / f"dst_profile_{slug}.txt", info, text)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
