"""Batch-1 graph-network inference in the GAMLP style: snack against Dense+Mask and dense.

    python examples/graph_inference.py                     # width 5000 (as in the SNACK paper) and 16384
    python examples/graph_inference.py --tiny              # seconds on a CPU (what the tests run)

Decoupled graph networks propagate node features over the graph once, ahead of time
(X, AX, A^2X, ... with the symmetrically normalised adjacency), and then answer queries with an MLP
on the concatenated hops, one node at a time. The graph here is GENERATED (a stochastic block model
from networkx, 20 communities, features = community centroid + noise): no package on this machine
ships a real graph large enough, and nothing is downloaded. The MLP: a dense input projection
(hops x features -> width), `layers` hidden width x width layers that are SparseLinear (snack),
a dense weight times a mask (Dense+Mask) or dense, and a dense classifier. ReLU follows every
layer; snack fuses it into its kernel (`SparseLinear(..., activation="relu")`). Latency is the median of
batch-1 forwards replayed from a captured CUDA graph (plain calls on a CPU); memory is the peak
allocated during inference. Writes bench/results/graph_<gpu>.csv and .md on a GPU.
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

COLUMNS = ["impl", "M", "K", "layers", "sparsity", "latency_us", "peak_mib"]


def propagated_features(nodes: int, feats: int, hops: int, seed: int) -> torch.Tensor:
    """[nodes, (hops + 1) * feats]: X, AX, ..., A^hops X on a generated stochastic block model."""
    import networkx as nx

    blocks = 20
    sizes = [nodes // blocks] * blocks
    sizes[0] += nodes - sum(sizes)
    p_in, p_out = min(1.0, 8.0 / sizes[0]), 2.0 / nodes
    probs = [[p_in if i == j else p_out for j in range(blocks)] for i in range(blocks)]
    graph = nx.stochastic_block_model(sizes, probs, seed=seed, sparse=True)
    edges = torch.tensor(list(graph.edges()), dtype=torch.long).t()
    src = torch.cat([edges[0], edges[1], torch.arange(nodes)])
    dst = torch.cat([edges[1], edges[0], torch.arange(nodes)])
    deg = torch.bincount(src, minlength=nodes).float()
    weight = deg[src].rsqrt() * deg[dst].rsqrt()
    adj = torch.sparse_coo_tensor(torch.stack([src, dst]), weight, (nodes, nodes), check_invariants=True).coalesce()
    gen = torch.Generator().manual_seed(seed)
    community = torch.repeat_interleave(torch.arange(blocks), torch.tensor(sizes))
    centroids = torch.randn(blocks, feats, generator=gen)
    x = centroids[community] + torch.randn(nodes, feats, generator=gen)
    out = [x]
    for _ in range(hops):
        out.append(torch.sparse.mm(adj, out[-1]))
    return torch.cat(out, dim=1)


def make_model(impl, in_dim, width, layers, classes, sparsity, device, seed):
    torch.manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = []
    for _ in range(layers):
        if impl == "dense":
            hidden += [nn.Linear(width, width, device=device), nn.ReLU()]
        else:
            # snack fuses the ReLU into the kernel's epilogue (activation="relu"): one launch per
            # layer. Dense+Mask gets the same weights and a separate ReLU, as PyTorch code would.
            layer = snack.SparseLinear(width, width, sparsity=sparsity, device=device, generator=gen,
                                       activation="relu")
            hidden += [layer] if impl == "snack" else [snack.dst.DenseMaskLinear.from_sparse(layer), nn.ReLU()]
    return nn.Sequential(nn.Linear(in_dim, width, device=device), nn.ReLU(), *hidden,
                         nn.Linear(width, classes, device=device)).eval()


def latency_us(model, features, device, reps):
    x_static = features[:1].clone()
    with torch.no_grad():
        if device.type != "cuda":
            for i in range(3):
                model(features[i:i + 1])
            times = []
            for i in range(reps):
                t0 = time.perf_counter()
                model(features[i % features.shape[0]:][:1])
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        graph = benchmark.capture_graph(lambda: model(x_static))
        # A new node each query, loaded outside the timed replay.
        times = benchmark.replay_times_ms(graph, reps, lambda i: x_static.copy_(features[i % features.shape[0]:][:1]))
        return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="5000,16384")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--sparsities", default="0.9,0.95,0.99")
    parser.add_argument("--nodes", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--tiny", action="store_true", help="width 256, 2 layers, 2000 nodes (tests)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results on a GPU)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.widths, args.layers, args.nodes, args.reps, args.sparsities = "256", 2, 2000, 20, "0.9"
    device = torch.device(args.device)
    feats, hops, classes = 128, 3, 20
    features = propagated_features(args.nodes, feats, hops, seed=0).to(device)
    print(f"generated SBM graph: {args.nodes} nodes, features {tuple(features.shape)} after {hops} hops; device {device}")
    rows = []
    for width in map(int, args.widths.split(",")):
        for sparsity in map(float, args.sparsities.split(",")):
            reference = None  # snack's answers for a few nodes, which Dense+Mask (same weights) must match
            for impl in ("snack", "dense_mask", "dense"):
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                model = make_model(impl, features.shape[1], width, args.layers, classes, sparsity, device, seed=1)
                lat = latency_us(model, features, device, args.reps)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
                if impl != "dense":  # after the peak is read: the check's batch of 8 is not part of the measurement
                    with torch.no_grad():
                        answers = model(features[:8])
                    if reference is None:
                        reference = answers.double()
                    else:
                        err = benchmark.rel_error(answers, reference)
                        if not err < 1e-4:
                            raise RuntimeError(f"snack and Dense+Mask disagree at width {width}, sparsity "
                                               f"{sparsity}: relative error {err:.2e}")
                rows.append(dict(impl=impl, M=width, K=width, layers=args.layers, sparsity=sparsity, latency_us=lat,
                                 peak_mib=peak))
                print(f"  width {width} s={sparsity} {impl:<10} {lat:9.1f} us  {peak:9.1f} MiB")
                del model
    out = benchmark.results_folder(args.out, device)
    if out is not None:
        info = benchmark.provenance(device)
        info["graph"] = f"generated stochastic block model, {args.nodes} nodes, 20 communities, {hops} hops"
        info["model"] = (f"input {features.shape[1]} -> width (dense), {args.layers} hidden width x width layers "
                         f"(the compared ones), width -> {classes} (dense); batch 1, CUDA-graph replay")
        stem = out / f"graph_{benchmark.gpu_slug(device)}"
        benchmark.write_csv(stem.with_suffix(".csv"), info, COLUMNS, rows)
        _report(stem, rows, info)
    return 0


def _report(stem: Path, rows, info) -> None:
    by = {(r["M"], r["sparsity"], r["impl"]): r for r in rows}
    lines = benchmark.markdown_head("Batch-1 graph-style inference", info)
    lines += ["| width | sparsity | snack us | Dense+Mask us | dense us | speedup vs D+M | snack MiB | D+M MiB | "
              "memory vs D+M |", "|---|---|---|---|---|---|---|---|---|"]
    for (w, s, impl), r in sorted(by.items()):
        if impl != "snack" or (w, s, "dense_mask") not in by:
            continue
        d = by[(w, s, "dense_mask")]
        dense = by.get((w, s, "dense"), {"latency_us": float("nan")})
        lines.append(f"| {w} | {s:g} | {r['latency_us']:.1f} | {d['latency_us']:.1f} | {dense['latency_us']:.1f} | "
                     f"{d['latency_us'] / r['latency_us']:.1f}x | {r['peak_mib']:.1f} | {d['peak_mib']:.1f} | "
                     f"{d['peak_mib'] / max(r['peak_mib'], 1e-9):.1f}x less |")
    lines += ["", "Targets at 99%: >= 10x faster than Dense+Mask, >= 3x less memory."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = benchmark.pyplot()
    if plt is None:
        return
    widths = sorted({r["M"] for r in rows})
    fig, axes = plt.subplots(1, len(widths), figsize=(5.5 * len(widths), 4), squeeze=False)
    for ax, w in zip(axes[0], widths):
        for impl in ("snack", "dense_mask", "dense"):
            pts = sorted((r["sparsity"], r["latency_us"]) for r in rows if r["M"] == w and r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_title(f"width {w}")
        ax.set_xlabel("sparsity")
        ax.set_ylabel("batch-1 latency (us)")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(f"graph-style inference - {info['gpu']}, commit {info['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
