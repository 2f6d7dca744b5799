"""The paths of a sparse 1x1 convolution on NCHW images, each forced, beside the planner's choice and
the dense convolution: the evidence for `plan_channels_first` (src/spmm/plan.cpp).

    python bench/conv_paths.py                 # MobileNetV1's pointwise layers, widths 1 and 2
    python bench/conv_paths.py --widths 1 --batches 1 --dtypes bf16

For every distinct pointwise layer of MobileNetV1 (examples/mobilenet.py) at --sparsity, 1 and 64
images of 224 x 224 inputs, fp32 and bf16: the microseconds of `snack.ops.spmm_channels_first` with
each path forced (in_place, pixel_rows, dense_blocks), of `SparseConv2d` as planned (snack, with the
path `snack.explain` names), and of `nn.Conv2d` (cuDNN; fp32 with PyTorch's default
`torch.backends.cudnn.allow_tf32`, which snack's dense path follows as well). CUDA-graph replays,
median. Writes bench/results/conv_paths_<gpu>.csv, .md and .png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

import snack
from snack import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mobilenet import BLOCKS  # noqa: E402  (the model's layers, one source)

COLUMNS = ["width", "batch", "dtype", "in_channels", "out_channels", "side", "plan", "snack_us", "in_place_us",
           "pixel_rows_us", "dense_blocks_us", "cudnn_us"]
PATHS = snack.CHANNELS_FIRST_PATHS
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def pointwise_layers(width: float) -> list[tuple[int, int, int]]:
    """(in channels, out channels, image side) of each distinct pointwise layer at 224 x 224."""
    def ch(c):
        return max(8, int(c * width))

    layers, cin, side = [], ch(32), 112
    for cout, stride in BLOCKS:
        side //= stride
        layers.append((cin, ch(cout), side))
        cin = ch(cout)
    return list(dict.fromkeys(layers))


def replay_us(fn, reps: int) -> float:
    graph = benchmark.capture_graph(fn)
    return 1e3 * statistics.median(benchmark.replay_times_ms(graph, reps))


def measure(width, batch, dtype, cin, cout, side, sparsity, reps) -> dict:
    torch.manual_seed(cin * 7 + cout)
    conv = nn.Conv2d(cin, cout, 1, device="cuda", dtype=DTYPES[dtype])
    layer = snack.for_inference(snack.SparseConv2d.from_dense(conv, sparsity=sparsity))
    x = torch.randn(batch, cin, side, side, device="cuda", dtype=DTYPES[dtype])
    images = x.view(batch, cin, side * side)
    row = dict(width=width, batch=batch, dtype=dtype, in_channels=cin, out_channels=cout, side=side,
               plan=snack.explain(layer, batch * side * side, op="channels_first", pixels=side * side).variant)
    with torch.no_grad():
        row["snack_us"] = replay_us(lambda: layer(x), reps)
        for path in PATHS:
            row[f"{path}_us"] = replay_us(lambda: snack.ops.spmm_channels_first(
                images, layer.values, layer.pattern.tensors, layer.bias, "none", path), reps)
        row["cudnn_us"] = replay_us(lambda: conv(x), reps)
    return row


def write_report(stem: Path, info: dict, rows: list[dict]) -> None:
    benchmark.write_csv(stem.with_suffix(".csv"), info, COLUMNS, rows)
    lines = benchmark.markdown_head("Sparse 1x1 convolutions on NCHW images: each path, the planner, cuDNN", info)
    lines += ["Microseconds (CUDA-graph replay, median). in_place / pixel_rows / dense_blocks: "
              "`spmm_channels_first` forced; snack: `SparseConv2d` as planned (its path in `plan`); cuDNN: "
              "`nn.Conv2d`. best: the fastest forced path, and the planner's time over it.", "",
              "| width | images | dtype | layer | side | plan | snack | in_place | pixel_rows | dense_blocks | cuDNN | "
              "plan / best | snack / cuDNN |", "|---|" * 13]
    within = 0
    for r in rows:
        best = min(r[f"{p}_us"] for p in PATHS)
        planned = r[f"{r['plan']}_us"]
        within += planned <= 1.1 * best
        lines.append(f"| {r['width']:g} | {r['batch']} | {r['dtype']} | {r['in_channels']}->{r['out_channels']} | "
                     f"{r['side']} | {r['plan']} | {r['snack_us']:.1f} | {r['in_place_us']:.1f} | "
                     f"{r['pixel_rows_us']:.1f} | {r['dense_blocks_us']:.1f} | {r['cudnn_us']:.1f} | "
                     f"{planned / best:.2f} | {r['cudnn_us'] / r['snack_us']:.2f}x |")
    lines += ["", f"The planner's path is within 10% of the fastest in {within} of {len(rows)} rows."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = benchmark.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(7, 0.22 * len(rows)), 4.5))
    for path, marker in zip(PATHS, "o^s"):
        ax.plot(range(len(rows)), [r["cudnn_us"] / r[f"{path}_us"] for r in rows], marker, ms=4, label=path)
    ax.plot(range(len(rows)), [r["cudnn_us"] / r["snack_us"] for r in rows], "k_", ms=9, label="snack (planned)")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [f"w{r['width']:g} b{r['batch']} {r['dtype']} {r['in_channels']}->"
                                     f"{r['out_channels']}@{r['side']}" for r in rows], rotation=90, fontsize=5)
    ax.set_ylabel("cuDNN time / path time")
    ax.set_title(f"Sparse 1x1 convolutions, NCHW - {info['gpu']}, commit {benchmark.short_commit(info)}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="1,2")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--dtypes", default="fp32,bf16", help="of " + ", ".join(DTYPES))
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/conv_paths.py times CUDA paths: no GPU here")
    info = benchmark.provenance(torch.device("cuda"))
    info["run"] = (f"MobileNetV1's pointwise layers at {args.sparsity:g} sparsity, uniform patterns, 224x224 inputs, "
                   f"median of {args.reps} replays; TF32 for cuDNN: {torch.backends.cudnn.allow_tf32}")
    grid = [(float(w), int(b), d, *layer) for w in args.widths.split(",") for d in args.dtypes.split(",")
            for b in args.batches.split(",") for layer in pointwise_layers(float(w))]
    rows = [measure(*g, args.sparsity, args.reps) for g in benchmark.progress(grid, len(grid), "conv paths")]
    stem = args.out / f"conv_paths_{benchmark.gpu_slug(torch.device('cuda'))}"
    write_report(stem, info, rows)
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
