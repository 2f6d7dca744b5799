"""A sparse Transformer: GPT-2 small with 90%-sparse weights and attention over a sparse pattern,
against the same sparse-weight model with dense attention and against dense GPT-2, in one run.

    python examples/sparse_transformer.py                    # sequences of 1k, 4k, 16k tokens, 16k tokens per step
    python examples/sparse_transformer.py --tiny --steps 2   # seconds on a CPU (what the tests run)

The model and corpus are those of examples/gpt2_dst.py (GPT2LMHeadModel from its config, bytes of
Python's standard library, every 10th file held out), trained with AdamW in bf16 autocast on a GPU
(fp32 on a CPU). The impls:
- snack: weights made sparse by snack.sparsify (attention and MLP projections, ERK) and attention by
  snack.nn.functional.sparse_attention over a causal local + random pattern of --attention-density
  of the seq x seq matrix (three quarters of each row's keys the nearest ones, a quarter drawn);
- snack_dense_attention: the same sparse weights, attention by scaled_dot_product_attention (causal);
- flex: the same sparse weights and pattern, attention by FlexAttention (compiled) with that pattern
  as a mask (a block mask over a boolean lookup table; GPU only: FlexAttention has no CPU backward);
- dense: GPT-2 as it is (scaled_dot_product_attention).
Each reports the median eager step time, the training peak memory and the held-out loss after the
last step. On a GPU it writes bench/results/sparse_transformer_<gpu>.csv, .md and a plot.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt2_dst  # noqa: E402  the model, corpus and batches of the GPT-2 example

import snack  # noqa: E402
from snack import benchmark  # noqa: E402

COLUMNS = ["impl", "seq", "batch", "dtype", "attention_density", "steps", "step_ms", "peak_mib", "heldout_loss"]
IMPLS = ("snack", "snack_dense_attention", "flex", "dense")


def attention_pattern(seq: int, density: float, device, seed: int) -> snack.Pattern:
    """Causal: each query's nearest 3/4 * density * seq keys, and 1/4 * density * seq drawn at random."""
    keys = max(1, int(density * seq))
    return snack.attention.local_pattern(seq, max(0, (3 * keys) // 4 - 1), random_per_row=max(0, keys // 4),
                                         causal=True, generator=torch.Generator().manual_seed(seed), device=device)


class Attention:
    """The attention functions registered with transformers, reading the pattern of the current run."""

    pattern: snack.Pattern = None
    flex_mask = None

    @staticmethod
    def snack(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = snack.nn.functional.sparse_attention(query, key, value, Attention.pattern, scale=scaling)
        return out.transpose(1, 2), None

    compiled_flex = None

    @staticmethod
    def flex(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # Compiled, as FlexAttention is meant to run (uncompiled it materialises the seq x seq scores).
        if Attention.compiled_flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            Attention.compiled_flex = torch.compile(flex_attention, dynamic=False)
        out = Attention.compiled_flex(query, key, value, block_mask=Attention.flex_mask, scale=scaling)
        return out.transpose(1, 2), None


def flex_block_mask(pattern: snack.Pattern, seq: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    table = pattern.to_mask().to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=str(device))


def build(impl: str, args, device):
    model = gpt2_dst.build_model(args, device)
    if impl != "dense":
        snack.sparsify(model, 1.0 - args.sparsity, include=["*.attn.c_attn", "*.attn.c_proj", "*.mlp.*"],
                       generator=torch.Generator(device=device).manual_seed(args.seed))
    from transformers import AttentionInterface

    AttentionInterface.register("snack_sparse", Attention.snack)
    AttentionInterface.register("snack_flex", Attention.flex)
    model.config._attn_implementation = {"snack": "snack_sparse", "flex": "snack_flex"}.get(impl, "sdpa")
    return model


def heldout_loss(model, data, dtype) -> float:
    model.eval()
    with torch.no_grad():
        losses = [gpt2_dst.lm_loss(model, x, y, dtype).item() for x, y in data]
    model.train()
    return sum(losses) / len(losses)


def run(impl: str, seq: int, args, corpus, heldout, device) -> dict:
    dtype = "bf16" if device.type == "cuda" else "fp32"
    args.block, args.batch = seq, max(1, args.tokens // seq)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    pattern = attention_pattern(seq, args.attention_density, device, args.seed)
    Attention.pattern = pattern
    Attention.flex_mask = flex_block_mask(pattern, seq, device) if impl == "flex" else None
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    model = build(impl, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = gpt2_dst.batches(corpus, args, device, torch.Generator().manual_seed(args.seed))
    held = [next(gpt2_dst.batches(heldout, args, device, torch.Generator().manual_seed(12345 + i)))
            for i in range(args.eval_batches)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        x, y = next(data)
        sync()
        t0 = time.perf_counter()
        gpt2_dst.train_step(model, opt, x, y, dtype)
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    row = dict(impl=impl, seq=seq, batch=args.batch, dtype=dtype, attention_density=args.attention_density,
               steps=args.steps, step_ms=1e3 * statistics.median(times[len(times) // 4:] or times), peak_mib=peak,
               heldout_loss=heldout_loss(model, held, dtype))
    print(f"  {impl:<22} seq {seq:>6} batch {args.batch:>3}: step {row['step_ms']:8.1f} ms, peak {peak:8.0f} MiB, "
          f"held-out loss {row['heldout_loss']:.4f}")
    del model, opt
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="1024,4096,16384")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch = tokens // seq)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sparsity", type=float, default=0.9, help="of the weights")
    parser.add_argument("--attention-density", type=float, default=0.05, help="of the seq x seq matrix")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide GPT-2, sequences of 64 (tests)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results on a GPU)")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("examples/sparse_transformer.py needs transformers (pip install transformers)")
        return 1
    if args.tiny:
        args.seqs, args.tokens = "64", 128
    seqs = [int(s) for s in args.seqs.split(",")]
    impls = args.impls.split(",")
    if any(i not in IMPLS for i in impls) or not 0 < args.attention_density <= 1 or not 0 < args.sparsity < 1:
        raise SystemExit(f"--impls from {IMPLS}; --attention-density in (0, 1]; --sparsity in (0, 1)")
    device = torch.device(args.device)
    corpus, heldout = gpt2_dst.load_corpus(2_000_000 if not args.tiny else 200_000)
    out = benchmark.results_folder(args.out, device)
    info = benchmark.provenance(device)
    info["run"] = (f"GPT-2 {'tiny' if args.tiny else 'small'}, weights {args.sparsity:g} sparse (ERK), attention "
                   f"pattern {args.attention_density:g} of seq x seq (causal local + random), {args.tokens} "
                   f"tokens per step, {args.steps} steps, AdamW lr {args.lr}")
    stem = out / f"sparse_transformer_{benchmark.gpu_slug(device)}" if out is not None else None
    rows = []
    for seq in seqs:
        print(f"== seq {seq}")
        for impl in impls:
            try:
                rows.append(run(impl, seq, args, corpus, heldout, device))
            except torch.cuda.OutOfMemoryError:
                print(f"  {impl} seq {seq}: out of memory")
                rows.append(dict(impl=impl, seq=seq, batch=max(1, args.tokens // seq), dtype="bf16",
                                 attention_density=args.attention_density, steps=args.steps, step_ms=float("nan"),
                                 peak_mib=float("nan"), heldout_loss=float("nan")))
            if stem is not None:  # the files so far: a run stopped part-way keeps what it measured
                benchmark.write_csv(stem.with_suffix(".csv"), info, COLUMNS, rows)
                _report(stem, rows, info, plot=False)
    if stem is not None:
        _report(stem, rows, info)
        print(f"wrote {stem}.csv, .md, .png")
    return 0


def _report(stem: Path, rows, info, plot: bool = True) -> None:
    lines = benchmark.markdown_head("Sparse Transformer", info)
    lines += ["Step ms: median eager training step; peak: training peak above what was allocated before the model; "
              "held-out loss: mean next-byte cross entropy on held-out files after the last step.", "",
              "| seq | batch | impl | step ms | peak MiB | held-out loss |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['seq']} | {r['batch']} | {r['impl']} | {r['step_ms']:.1f} | {r['peak_mib']:.0f} | "
              f"{r['heldout_loss']:.4f} |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = benchmark.pyplot() if plot else None
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        axes[0].plot([r["seq"] for r in mine], [r["step_ms"] for r in mine], marker="o", label=impl)
        axes[1].plot([r["seq"] for r in mine], [r["peak_mib"] for r in mine], marker="o", label=impl)
    for ax, label in zip(axes, ("step ms", "peak MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"Sparse Transformer - {info['gpu']}, commit {info['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
