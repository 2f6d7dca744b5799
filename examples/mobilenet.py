"""Sparse MobileNetV1: its pointwise (1x1) convolutions (snack.SparseConv2d) and its classifier
(SparseLinear) 90% sparse, against the dense model (cuDNN) in the same dtype and memory format.

    python examples/mobilenet.py                   # widths 1.0, 2.0; batch 1, 64; fp32, bf16; 224x224
    python examples/mobilenet.py --tiny            # seconds on a CPU (what the tests run)
    python examples/mobilenet.py --weights         # the weight memory alone, any device, no timing

Inference: both models as served, batch norms folded into the convolutions before them and each snack
layer's ReLU computed in its epilogue (snack.fuse_for_inference; the dense model keeps its ReLUs). In
the sparse model each block's depthwise convolution, its ReLU and its sparse pointwise convolution
become one snack.DepthwiseSeparable, one kernel on CUDA; snack_unfused times the
same sparse model with the three apart (fuse_for_inference(separable=False)).
The latency of a forward at 224 x 224 (on a GPU replayed from a CUDA graph, median), the
weight memory (parameters and buffers: for snack the values and what its patterns keep for inference,
snack.for_inference: column indices and row pointers, and the tile view of 16-bit layers) and the
inference peak (the weights plus what a forward allocates). Each impl runs on NCHW and on channels_last inputs;
bf16 converts the whole model (dense weights, snack values) to bfloat16.

Accuracy: a width-0.25 MobileNetV1 on 32 x 32 images, trained dense and with sparse DST (snack RigL
at the same sparsity of its pointwise convolutions), test accuracy after the same epochs. The image
set is the 8 x 8 handwritten digits that scikit-learn ships (1797 images, 10 classes), upscaled:
the only labelled images present on every machine here without a download (torchvision's sets
need one).

On a GPU it writes bench/results/mobilenet_<gpu>.csv, .md and a plot.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import snack
from snack import benchmark

COLUMNS = ["impl", "width", "batch", "dtype", "layout", "latency_us", "weight_mib", "peak_mib", "accuracy"]

# MobileNetV1 (Howard et al. 2017): after a 3x3 stem of 32 channels, 13 depthwise-separable blocks
# (a 3x3 depthwise convolution, then a 1x1 pointwise one), as (output channels, stride).
BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)] + [(512, 1)] * 5 + [(1024, 2), (1024, 1)]


def conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def mobilenet_v1(width: float, classes: int = 1000, in_channels: int = 3) -> nn.Sequential:
    """MobileNetV1 with the width multiplier `width` (channels rounded, at least 8)."""
    def ch(c):
        return max(8, int(c * width))

    layers, cin = [conv_bn(in_channels, ch(32), 3, 2)], ch(32)
    for cout, stride in BLOCKS:
        layers += [conv_bn(cin, cin, 3, stride, groups=cin), conv_bn(cin, ch(cout), 1, 1)]
        cin = ch(cout)
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def make_sparse(model: nn.Module, sparsity: float, seed: int) -> nn.Module:
    """The pointwise convolutions as SparseConv2d and the classifier as SparseLinear (ERK over them,
    `sparsity` of their weights gone); the 3x3 stem and the depthwise convolutions stay dense (sparsify
    leaves every convolution but the 1x1 ones)."""
    device = next(model.parameters()).device
    snack.sparsify(model, 1.0 - sparsity, include=lambda name, m: isinstance(m, (nn.Conv2d, nn.Linear)),
                   generator=torch.Generator(device=device).manual_seed(seed))
    return model


def weight_mib(model: nn.Module) -> float:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def latency_us(model, x, device, reps: int) -> float:
    """Median latency of model(x) without autograd: CUDA-graph replays on a GPU, wall time on a CPU."""
    with torch.no_grad():
        if device.type == "cuda":
            static = x.clone()
            graph = benchmark.capture_graph(lambda: model(static))
            return 1e3 * statistics.median(benchmark.replay_times_ms(graph, reps))
        model(x)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times)


def inference_peak_mib(model, x, device) -> float:
    """The weights plus the most a forward allocates on top of what was allocated before it."""
    if device.type != "cuda":
        return float("nan")
    with torch.no_grad():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(x)
        torch.cuda.synchronize()
        return weight_mib(model) + (torch.cuda.max_memory_allocated() - before) / 2**20


def inference_rows(args, device, rows: list[dict], save) -> None:
    """Appends the latency rows of every configuration to `rows`, calling save() after each."""
    grid = [(w, b, d, layout) for w in args.widths for b in args.batches for d in args.dtypes
            for layout in ("nchw", "channels_last")]
    for width, batch, dtype_name, layout in benchmark.progress(grid, len(grid), "inference"):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        torch.manual_seed(args.seed)
        dense = mobilenet_v1(width).to(device).eval()
        sparse = make_sparse(copy.deepcopy(dense), args.sparsity, args.seed)
        x = torch.randn(batch, 3, args.resolution, args.resolution, device=device).to(dtype=dtype, memory_format=fmt)
        unfused = copy.deepcopy(sparse)
        for impl, model in (("snack", sparse), ("snack_unfused", unfused), ("dense", dense)):
            model = snack.fuse_for_inference(model.to(dtype=dtype, memory_format=fmt),
                                             separable=impl != "snack_unfused")
            if impl != "dense":
                snack.for_inference(model)  # after the cast: 16-bit layers keep their tile view
            rows.append(dict(impl=impl, width=width, batch=batch, dtype=dtype_name, layout=layout,
                             latency_us=latency_us(model, x, device, args.reps), weight_mib=weight_mib(model),
                             peak_mib=inference_peak_mib(model, x, device), accuracy=float("nan")))
        del dense, sparse, unfused
        save()


def print_weights(args, device) -> None:
    """The weight memory of every width and dtype, both models with their batch norms folded: dense,
    snack with every array of its patterns, kept for inference (snack.for_inference's default) and
    kept without the tile view. Bytes do not depend on the device."""
    print(f"{'width':>6}{'dtype':>6}{'dense MiB':>11}{'snack MiB':>11}{'inference':>11}{'no tiles':>10}"
          f"{'smaller':>9}{'no tiles':>10}")
    for width in args.widths:
        torch.manual_seed(args.seed)
        dense = mobilenet_v1(width).to(device).eval()
        sparse = snack.fuse_for_inference(make_sparse(copy.deepcopy(dense), args.sparsity, args.seed))
        snack.fuse_for_inference(dense)
        for dtype_name in args.dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            whole = copy.deepcopy(sparse).to(dtype)
            kept = snack.for_inference(copy.deepcopy(whole))
            no_tiles = snack.for_inference(copy.deepcopy(whole), tile_view=False)
            d = weight_mib(dense.to(dtype))
            print(f"{width:>6g}{dtype_name:>6}{d:>11.2f}{weight_mib(whole):>11.2f}{weight_mib(kept):>11.2f}"
                  f"{weight_mib(no_tiles):>10.2f}{d / weight_mib(kept):>8.2f}x{d / weight_mib(no_tiles):>9.2f}x")


def digits(device, resolution: int, limit: int = 0):
    """scikit-learn's 8 x 8 digits as [N, 1, resolution, resolution] in [0, 1], split 80 / 20 (fixed seed)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0
    labels = torch.tensor(data.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    if limit:
        order = order[:limit]
    images = F.interpolate(images[order], size=(resolution, resolution), mode="bilinear", align_corners=False)
    labels = labels[order]
    cut = int(0.8 * len(labels))
    return ((images[:cut].to(device), labels[:cut].to(device)), (images[cut:].to(device), labels[cut:].to(device)))


def train_accuracy(impl: str, args, device) -> float:
    """Test accuracy of a width-`args.train_width` MobileNetV1 after `args.epochs` epochs of AdamW
    (snack: the sparse layers of make_sparse, RigL every `args.update_every` steps)."""
    (x_train, y_train), (x_test, y_test) = digits(device, args.train_resolution, 200 if args.tiny else 0)
    torch.manual_seed(args.seed)
    model = mobilenet_v1(args.train_width, classes=10, in_channels=1).to(device)
    if impl == "snack":
        make_sparse(model, args.sparsity, args.seed)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps_per_epoch = -(-len(y_train) // args.train_batch)
    sched = None
    if impl == "snack":
        sched = snack.dst.DSTScheduler(model, opt, algorithm="rigl", update_every=args.update_every,
                                       end=int(0.75 * args.epochs * steps_per_epoch), drop_fraction=0.3,
                                       generator=torch.Generator(device=device).manual_seed(args.seed))
    order_gen = torch.Generator().manual_seed(args.seed)
    for _ in range(args.epochs):
        model.train()
        for idx in torch.randperm(len(y_train), generator=order_gen).split(args.train_batch):
            idx = idx.to(device)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x_train[idx].contiguous(memory_format=torch.channels_last)), y_train[idx]).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        predicted = model(x_test.contiguous(memory_format=torch.channels_last)).argmax(1)
    if sched is not None:
        sched.remove()
    return float((predicted == y_test).float().mean())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="1.0,2.0")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--sparsity", type=float, default=0.9, help="of the pointwise convolutions' and classifier's weights")
    parser.add_argument("--resolution", type=int, default=224)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=30, help="training epochs of the accuracy comparison (0: none)")
    parser.add_argument("--train-width", type=float, default=0.25)
    parser.add_argument("--train-resolution", type=int, default=32)
    parser.add_argument("--train-batch", type=int, default=64)
    parser.add_argument("--update-every", type=int, default=20)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="width 0.25, 32 x 32, 1 epoch on 200 digits (tests)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results on a GPU)")
    parser.add_argument("--weights", action="store_true", help="print the weight memory of each width and dtype only")
    args = parser.parse_args(argv)
    if args.tiny:
        args.widths, args.batches, args.resolution, args.reps, args.epochs = "0.25", "1,2", 32, 2, 1
    args.widths = [float(w) for w in args.widths.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.dtypes = args.dtypes.split(",")
    if any(d not in ("fp32", "bf16") for d in args.dtypes) or not 0.0 < args.sparsity < 1.0:
        raise SystemExit("--dtypes takes fp32 and/or bf16; --sparsity lies in (0, 1)")
    device = torch.device(args.device)
    if args.weights:
        print_weights(args, device)
        return 0
    out = benchmark.results_folder(args.out, device)
    info = benchmark.provenance(device)
    info["run"] = (f"MobileNetV1, pointwise convolutions and classifier {args.sparsity:g} sparse (ERK), {args.resolution}x"
                   f"{args.resolution}, {args.reps} replays; accuracy: width {args.train_width:g}, "
                   f"{args.train_resolution}x{args.train_resolution} digits, {args.epochs} epochs")
    stem = out / f"mobilenet_{benchmark.gpu_slug(device)}" if out is not None else None
    rows: list[dict] = []

    def save(plot: bool = False) -> None:
        """The result files so far (a run stopped part-way keeps what it measured)."""
        if stem is not None:
            benchmark.write_csv(stem.with_suffix(".csv"), info, COLUMNS, rows)
            _report(stem, rows, info, plot)

    inference_rows(args, device, rows, save)
    if args.epochs > 0:
        for impl in ("snack", "dense"):
            rows.append(dict(impl=impl, width=args.train_width, batch=args.train_batch, dtype="fp32",
                             layout="channels_last", latency_us=float("nan"), weight_mib=float("nan"),
                             peak_mib=float("nan"), accuracy=train_accuracy(impl, args, device)))
    print(f"\n{'impl':<14}{'width':>6}{'batch':>6}{'dtype':>6}{'layout':>15}{'latency us':>12}{'weights MiB':>12}"
          f"{'peak MiB':>10}{'accuracy':>9}")
    for r in rows:
        print(f"{r['impl']:<14}{r['width']:>6g}{r['batch']:>6}{r['dtype']:>6}{r['layout']:>15}{r['latency_us']:>12.1f}"
              f"{r['weight_mib']:>12.2f}{r['peak_mib']:>10.1f}{r['accuracy']:>9.3f}")
    if stem is not None:
        save(plot=True)
        print(f"wrote {stem}.csv, .md, .png")
    return 0


def _report(stem: Path, rows, info, plot: bool = True) -> None:
    lines = benchmark.markdown_head("Sparse MobileNetV1", info)
    lines += ["Both models with their batch norms folded (snack.fuse_for_inference; snack's layers also take their "
              "ReLU into the product). snack: each block's depthwise convolution, ReLU and sparse pointwise "
              "convolution as one snack.DepthwiseSeparable (one kernel on CUDA); "
              "snack unfused: the same sparse model with the three apart. "
              "Latency: one forward (CUDA-graph replay on a GPU, median). Weights: parameters and buffers (snack's "
              "patterns kept for inference, snack.for_inference). Peak: the weights plus what the forward allocates.",
              "",
              "| width | batch | dtype | layout | snack us | snack unfused us | dense us | speedup | unfused speedup | "
              "snack weights MiB | dense weights MiB | weights smaller | snack peak MiB | dense peak MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["impl"], r["width"], r["batch"], r["dtype"], r["layout"]): r for r in rows}
    for r in rows:
        if r["impl"] != "snack" or r["latency_us"] != r["latency_us"]:
            continue
        key = tuple(r[c] for c in ("width", "batch", "dtype", "layout"))
        d = by[("dense",) + key]
        u = by.get(("snack_unfused",) + key, {"latency_us": float("nan")})
        lines.append(f"| {r['width']:g} | {r['batch']} | {r['dtype']} | {r['layout']} | {r['latency_us']:.1f} | "
                     f"{u['latency_us']:.1f} | {d['latency_us']:.1f} | {d['latency_us'] / r['latency_us']:.2f}x | "
                     f"{d['latency_us'] / u['latency_us']:.2f}x | {r['weight_mib']:.2f} | "
                     f"{d['weight_mib']:.2f} | {d['weight_mib'] / r['weight_mib']:.1f}x | {r['peak_mib']:.1f} | "
                     f"{d['peak_mib']:.1f} |")
    trained = [r for r in rows if r["accuracy"] == r["accuracy"]]
    if trained:
        lines += ["", "## Accuracy (test split of the digits, after the same training)", "",
                  "| impl | width | accuracy |", "|---|---|---|"]
        lines += [f"| {r['impl']} | {r['width']:g} | {r['accuracy']:.3f} |" for r in trained]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = benchmark.pyplot() if plot else None
    if plt is None:
        return
    timed = [r for r in rows if r["impl"] == "snack" and r["latency_us"] == r["latency_us"]]
    labels = [f"w{r['width']:g} b{r['batch']}\n{r['dtype']} {r['layout'][:5]}" for r in timed]
    speedups = [by[("dense",) + tuple(r[c] for c in ("width", "batch", "dtype", "layout"))]["latency_us"] / r["latency_us"]
                for r in timed]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(timed)), 4.5))
    ax.bar(range(len(timed)), speedups)
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(range(len(timed)), labels, fontsize=7)
    ax.set_ylabel("dense latency / snack latency")
    ax.set_title(f"Sparse MobileNetV1 inference - {info['gpu']}, commit {info['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
