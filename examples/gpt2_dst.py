"""GPT-2 small with dynamic sparse training: snack against Dense+Mask DST and dense, in one run.

    python examples/gpt2_dst.py                          # GPT-2 small, batch 1 x 128, 90%, SET, 200 steps
    python examples/gpt2_dst.py --batch 8 --block 1024 --sparsity 0.95 --algorithm rigl
    python examples/gpt2_dst.py --tiny --steps 3         # seconds on a CPU (what the tests run)

The model is GPT2LMHeadModel built from GPT2Config (random initialisation, no download) with a
byte-level vocabulary of 256. The corpus is the source code of Python's standard library on this
machine (real text, present wherever Python is). The MLP and attention projections (Hugging Face
Conv1D) are made sparse with snack.sparsify (ERK at the given global density, lm_head stays dense:
it is tied to the embedding), then trained with AdamW and snack.dst.DSTScheduler. The Dense+Mask run
replaces each SparseLinear by snack.dst.DenseMaskLinear with the same weights, mask, rule and seed.

Reports per run: peak training memory, step time (eager; CUDA-graph and torch.compile timings are
not implemented yet), tokens/s, the loss curve, batch-1 greedy generation latency per token and
inference memory. On a GPU it writes bench/results/gpt2_<gpu>_<batch>x<block>_s<sparsity>.csv, .md
and a loss/memory plot. transformers is needed by this example only.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402
import snack  # noqa: E402

COLUMNS = ["impl", "batch", "block", "sparsity", "peak_mib", "step_ms", "tokens_per_s", "final_loss",
           "gen_ms_per_token", "infer_mib"]


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, in sorted path order, as a uint8 tensor."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise SystemExit(f"no Python sources found under {stdlib}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()


def build_model(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    if args.tiny:
        config = GPT2Config(vocab_size=256, n_positions=args.block, n_embd=64, n_layer=2, n_head=2)
    else:
        config = GPT2Config(vocab_size=256, n_positions=max(1024, args.block))
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config).to(device)


def make_variant(args, impl, device):
    model = build_model(args, device)
    densities = None
    if impl != "dense":
        densities = snack.sparsify(model, 1.0 - args.sparsity, include=["*.attn.c_attn", "*.attn.c_proj", "*.mlp.*"],
                                   generator=torch.Generator(device=device).manual_seed(args.seed))
        if impl == "dense_mask":
            for name, module in list(model.named_modules()):
                if isinstance(module, snack.SparseLinear):
                    parent_name, _, child = name.rpartition(".")
                    setattr(model.get_submodule(parent_name), child, snack.dst.DenseMaskLinear.from_sparse(module))
    return model, densities


def batches(corpus, args, device, gen):
    n = corpus.numel() - args.block - 1
    while True:
        starts = torch.randint(0, n, (args.batch,), generator=gen)
        x = torch.stack([corpus[s:s + args.block + 1] for s in starts.tolist()]).long().to(device)
        yield x[:, :-1], x[:, 1:]


def run(impl, args, corpus, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    model, _ = make_variant(args, impl, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = None
    if impl != "dense":
        sched = snack.dst.DSTScheduler(model, opt, algorithm=args.algorithm, update_every=args.update_every,
                                       end=int(0.75 * args.steps), drop_fraction=0.3,
                                       generator=torch.Generator(device=device).manual_seed(args.seed))
    data = batches(corpus, args, device, torch.Generator().manual_seed(args.seed))
    losses, times = [], []
    for step in range(args.steps):
        x, y = next(data)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(f"  [{impl}] step {step + 1:5d}  loss {losses[-1]:.4f}")
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    warm = times[len(times) // 4:] or times
    step_ms = 1e3 * sorted(warm)[len(warm) // 2]
    # Inference: drop training state, then greedy generation at batch 1 with the KV cache.
    del opt, sched
    model.eval()
    for p in model.parameters():
        p.grad = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        infer_base = torch.cuda.memory_allocated()
    prompt = corpus[: min(32, args.block // 2)].long().to(device)[None]
    new_tokens = 8 if args.tiny else 64
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        sync()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync()
    gen_ms = 1e3 * (time.perf_counter() - t0) / new_tokens
    infer = (torch.cuda.max_memory_allocated() / 2**20) if device.type == "cuda" else float("nan")
    row = dict(impl=impl, batch=args.batch, block=args.block, sparsity=args.sparsity, peak_mib=peak, step_ms=step_ms,
               tokens_per_s=args.batch * args.block / (step_ms / 1e3), final_loss=sum(losses[-5:]) / len(losses[-5:]),
               gen_ms_per_token=gen_ms, infer_mib=infer)
    del model
    return row, losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="all", choices=["all", "snack", "dense_mask", "dense"])
    parser.add_argument("--algorithm", default="set", choices=["set", "rigl"])
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--update-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide GPT-2 (tests)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results on a GPU)")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("examples/gpt2_dst.py needs transformers (pip install transformers)")
        return 1
    device = torch.device(args.device)
    corpus = load_corpus(2_000_000 if not args.tiny else 200_000)
    print(f"corpus: {corpus.numel():,} bytes of Python standard-library source; device {device}")
    impls = ["snack", "dense_mask", "dense"] if args.impl == "all" else [args.impl]
    rows, curves = [], {}
    for impl in impls:
        row, losses = run(impl, args, corpus, device)
        rows.append(row)
        curves[impl] = losses
    print(f"\n{'impl':<12}{'peak MiB':>10}{'step ms':>10}{'tok/s':>10}{'loss':>9}{'gen ms/tok':>12}{'infer MiB':>11}")
    for r in rows:
        print(f"{r['impl']:<12}{r['peak_mib']:>10.1f}{r['step_ms']:>10.2f}{r['tokens_per_s']:>10.0f}"
              f"{r['final_loss']:>9.4f}{r['gen_ms_per_token']:>12.2f}{r['infer_mib']:>11.1f}")
    out = args.out if args.out is not None else (common.RESULTS_DIR if device.type == "cuda" else None)
    if out is not None:
        info = common.provenance()
        info["run"] = (f"GPT-2 {'tiny' if args.tiny else 'small'}, {args.algorithm}, {args.steps} steps, "
                       f"update every {args.update_every}, AdamW lr {args.lr}, corpus stdlib sources")
        slug = common.gpu_slug()
        suffix = f"_{args.batch}x{args.block}_s{args.sparsity:g}"
        common.write_csv(out / f"gpt2_{slug}{suffix}.csv", info, COLUMNS, rows)
        _report(out / f"gpt2_{slug}{suffix}", rows, curves, info)
    return 0


def _report(stem: Path, rows, curves, info) -> None:
    by = {r["impl"]: r for r in rows}
    lines = ["# GPT-2 dynamic sparse training", ""] + [f"- {k}: {v}" for k, v in info.items()] + [""]
    lines += ["| impl | peak MiB | step ms | tokens/s | final loss | gen ms/token | inference MiB |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['impl']} | {r['peak_mib']:.1f} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['final_loss']:.4f} | {r['gen_ms_per_token']:.2f} | {r['infer_mib']:.1f} |" for r in rows]
    if "snack" in by and "dense_mask" in by:
        s, d = by["snack"], by["dense_mask"]
        lines += ["", f"- peak training memory vs Dense+Mask: {100 * (1 - s['peak_mib'] / d['peak_mib']):.0f}% less "
                      "(target >= 50%)",
                  f"- final loss vs Dense+Mask: {100 * (s['final_loss'] / d['final_loss'] - 1):+.2f}% (target within 2%)",
                  f"- step time vs Dense+Mask: {d['step_ms'] / s['step_ms']:.2f}x (target >= 1x)"]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for impl, losses in curves.items():
        axes[0].plot(losses, label=impl)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend()
    axes[1].bar(list(by), [by[i]["peak_mib"] for i in by])
    axes[1].set_ylabel("peak training MiB")
    fig.suptitle(f"GPT-2 DST - {info['gpu']}, commit {info['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
