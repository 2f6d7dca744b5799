"""Host time of eager calls of sparse layers: what Python, the dispatcher and autograd cost per layer,
measured where the kernels are negligible (the floor of an eager step at small batches).

    python bench/host.py                 # on the GPU if there is one, else on the CPU
    python bench/host.py --device cpu

A stack of --layers SparseLinear layers of --features x --features at 90% sparsity (and its dense
twin, nn.Linear), a batch of --rows rows. Timed per pass over the stack, reported per layer (median
of --reps passes, each ended by a device synchronisation):

- inference: the forward under torch.inference_mode;
- forward: the forward under autograd (parameters that learn);
- step: forward, backward and the optimizer's step; for snack with snack.optim.AdamW (its update
  fused into the backward) and with torch.optim.AdamW (foreach), for the dense twin with
  torch.optim.AdamW (foreach).

The products of 64 x 64 weights over 4 rows, and AdamW's update of 4096 dense weights, take a few
microseconds or less on either device, so the passes are bound by the host: the figures are host
time (on a CPU, with the tiny products in it).
Writes bench/results/host_<gpu or cpu>.csv, .md and .png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import snack
from snack import benchmark

COLUMNS = ["impl", "phase", "layers", "features", "rows", "us_per_layer"]
IMPLS = ("snack", "snack_torch_adamw", "dense")


def model_of(impl: str, layers: int, features: int, device) -> nn.Module:
    torch.manual_seed(0)
    if impl == "dense":
        stack = [nn.Linear(features, features, device=device) for _ in range(layers)]
    else:
        stack = [snack.SparseLinear(features, features, sparsity=0.9, device=device) for _ in range(layers)]
    return nn.Sequential(*stack)


def pass_us(fn, device, reps: int) -> float:
    """Median time of fn() over reps calls, each ended by a synchronisation of the device."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(max(5, reps // 10)):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def measure(impl: str, phase: str, args, device) -> float:
    model = model_of(impl, args.layers, args.features, device)
    x = torch.randn(args.rows, args.features, device=device)
    if phase == "inference":
        def run():
            with torch.inference_mode():
                model(x)
    elif phase == "forward":
        def run():
            model(x)
    else:
        opt_class = snack.optim.AdamW if impl == "snack" else torch.optim.AdamW
        opt = opt_class(model.parameters(), lr=1e-4)

        def run():
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()
    return pass_us(run, device, args.reps) / args.layers


def write_report(stem: Path, info: dict, rows: list[dict]) -> None:
    benchmark.write_csv(stem.with_suffix(".csv"), info, COLUMNS, rows)
    us = {(r["impl"], r["phase"]): r["us_per_layer"] for r in rows}
    phases = [p for p in ("inference", "forward", "step") if any(k[1] == p for k in us)]
    lines = benchmark.markdown_head("Host time of eager layer calls", info)
    lines += ["Microseconds per layer and call (median of whole passes over the stack, divided by its layers). "
              "snack: SparseLinear, 90% sparse, its step by snack.optim.AdamW (fused into the backward); "
              "snack_torch_adamw: the same layers stepped by torch.optim.AdamW; dense: nn.Linear, torch.optim.AdamW.",
              "", "| phase | " + " | ".join(IMPLS) + " | snack / dense |", "|---|" + "---|" * (len(IMPLS) + 1)]
    for phase in phases:
        cells = [f"{us[(i, phase)]:.1f}" if (i, phase) in us else "-" for i in IMPLS]
        both = ("snack", phase) in us and ("dense", phase) in us
        ratio = us[("snack", phase)] / us[("dense", phase)] if both else None
        lines.append(f"| {phase} | " + " | ".join(cells) + (f" | {ratio:.2f}x |" if ratio else " | - |"))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = benchmark.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(IMPLS)
    for j, impl in enumerate(IMPLS):
        heights = [us.get((impl, p), 0.0) for p in phases]
        ax.bar([i + j * width for i in range(len(phases))], heights, width, label=impl)
    ax.set_xticks([i + width * (len(IMPLS) - 1) / 2 for i in range(len(phases))], phases)
    ax.set_ylabel("us per layer")
    ax.set_title(f"Host time per layer ({info['gpu'] if info['gpu'] != 'none' else info['cpu']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    info = benchmark.provenance(device)
    info["cpu"] = benchmark.cpu_name()
    info["run"] = (f"{args.layers} layers of {args.features}x{args.features}, {args.rows} rows, median of "
                   f"{args.reps} passes")
    stem = args.out / f"host_{benchmark.gpu_slug(device)}"
    grid = [(impl, phase) for phase in ("inference", "forward", "step") for impl in IMPLS
            if not (impl == "snack_torch_adamw" and phase != "step")]
    rows = []
    for impl, phase in benchmark.progress(grid, len(grid), "host"):
        rows.append(dict(impl=impl, phase=phase, layers=args.layers, features=args.features, rows=args.rows,
                         us_per_layer=measure(impl, phase, args, device)))
    write_report(stem, info, rows)
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
