"""GPT-2 small with dynamic sparse training: snack against Dense+Mask DST and dense, in one run.

    python examples/gpt2_dst.py                          # GPT-2 small, batch 1 x 128, 90%, SET, 200 steps
    python examples/gpt2_dst.py --configs 1x128:0.9,1x128:0.99,8x1024:0.9:50 --algorithm rigl
    python examples/gpt2_dst.py --tiny --steps 3         # seconds on a CPU (what the tests run)

`--configs` lists BATCHxBLOCK:SPARSITY[:STEPS] runs; each trains snack, Dense+Mask and dense, in
each of `--dtypes` (fp32; bf16: the forward under torch.autocast(bfloat16), float32 weights, as
mixed-precision training runs; generation then runs on the trained model converted to bf16, as such a
model is served: no float32 weights cast at every token).

The model is GPT2LMHeadModel built from GPT2Config (random initialisation, no download) with a
byte-level vocabulary of 256. The corpus is the source code of Python's standard library on this
machine (real text, present wherever Python is). The MLP and attention projections (Hugging Face
Conv1D) are made sparse with snack.sparsify (ERK at the given global density, lm_head stays dense:
it is tied to the embedding), then trained with AdamW and snack.dst.DSTScheduler. The Dense+Mask run
replaces each SparseLinear by snack.dst.DenseMaskLinear with the same weights, mask, rule and seed.

Every 10th source file (in sorted path order) is held out of training: each run reports its
perplexity there after the last step (and every --eval-every steps, plotted), on the same fixed
held-out batches for every run of the invocation.

Reports per run: peak training memory, step time (the wall time of an eager step, and on a GPU the
GPU time of the whole step - forward, backward, AdamW - replayed from a captured CUDA graph, timed
after training; topology updates rewrite the slots in place, so such a graph stays valid across
them, see tests/python/test_training.py), tokens/s of the eager step, the loss curve, batch-1 greedy generation
latency per token and inference memory (snack's patterns kept for inference, snack.for_inference, once
training is over).
On a GPU it writes bench/results/gpt2_<gpu>.csv, .md and a plot (loss curves, memory bars) with
every config of the invocation. transformers is needed by this example only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

import snack
from snack import benchmark

COLUMNS = ["impl", "dtype", "batch", "block", "sparsity", "steps", "peak_mib", "peak_update_mib", "step_ms", "graph_step_ms", "tokens_per_s",
           "final_loss", "heldout_ppl", "gen_ms_per_token", "infer_mib"]
HELDOUT_EVERY = 10  # every 10th source file (in sorted path order) is held out of training


def load_corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the standard library's .py files, in sorted path order, as uint8 tensors: the
    training text (up to max_bytes) and the held-out text (every HELDOUT_EVERY-th file, never trained
    on; up to max_bytes // 4)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, heldout, totals = [], [], [0, 0]
    paths = [p for p in sorted(stdlib.rglob("*.py")) if "site-packages" not in p.parts]
    for i, path in enumerate(paths):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        held = i % HELDOUT_EVERY == HELDOUT_EVERY - 1
        if totals[held] < (max_bytes // 4 if held else max_bytes):
            (heldout if held else train).append(data)
            totals[held] += len(data)
        if totals[0] >= max_bytes and totals[1] >= max_bytes // 4:
            break
    if totals[0] == 0 or totals[1] == 0:
        raise SystemExit(f"too few Python sources under {stdlib} for a training and a held-out text")

    def as_tensor(chunks, limit):
        return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).clone()

    return as_tensor(train, max_bytes), as_tensor(heldout, max_bytes // 4)


def build_model(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    # No dropout (as in nanoGPT-style pretraining): the three runs then differ only by their weights,
    # and a whole step can be captured in a CUDA graph without the RNG in it.
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if args.tiny:
        config = GPT2Config(vocab_size=256, n_positions=args.block, n_embd=64, n_layer=2, n_head=2, **no_dropout)
    else:
        config = GPT2Config(vocab_size=256, n_positions=max(1024, args.block), **no_dropout)
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


def batches(corpus, args, device, gen, batch=None):
    n = corpus.numel() - args.block - 1
    while True:
        starts = torch.randint(0, n, (batch or args.batch,), generator=gen)
        x = torch.stack([corpus[s:s + args.block + 1] for s in starts.tolist()]).long().to(device)
        yield x[:, :-1], x[:, 1:]


def heldout_batches(heldout, args, device) -> list:
    """The held-out evaluation set: args.eval_batches batches of max(batch, 8) sequences at fixed
    positions, the same for every run of the invocation."""
    if args.block + 1 >= heldout.numel():
        raise SystemExit(f"the held-out text ({heldout.numel()} bytes) is shorter than a block of {args.block}")
    data = batches(heldout, args, device, torch.Generator().manual_seed(12345), batch=max(args.batch, 8))
    return [next(data) for _ in range(args.eval_batches)]


def lm_loss(model, x, y, dtype: str, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy of the model on x against y, its forward in the run's precision."""
    with precision(dtype, x.device):
        logits = model(x).logits.float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


def heldout_perplexity(model, data, dtype: str) -> float:
    """exp(mean next-token cross entropy) over the held-out batches, in the training precision."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        total = sum(lm_loss(model, x, y, dtype, reduction="sum").item() for x, y in data)
    model.train(was_training)
    return math.exp(total / sum(y.numel() for _, y in data))


def precision(dtype: str, device) -> contextlib.AbstractContextManager:
    """The forward's precision: fp32 as it is, bf16 under autocast. Autocast's cache stays off, as
    CUDA-graph capture of the step requires (and the step casts its weights once per forward anyway)."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


def train_step(model, opt, x, y, dtype: str = "fp32") -> torch.Tensor:
    """One language-model training step (next-token cross entropy, AdamW); returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model, x, y, dtype)
    loss.backward()
    opt.step()
    return loss


def run(impl, args, corpus, heldout, device, dtype="fp32"):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        gc.collect()  # the previous run's model and optimizer sit in reference cycles until collected
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    model, _ = make_variant(args, impl, device)
    if impl == "snack" and dtype == "fp32":
        snack.for_training(model, tile_view=False)  # no product runs in 16 bits: the tile view is never read
    if device.type == "cuda":
        # Training peak from here: building the dense model and sparsifying it is not a training cost.
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = None
    if impl != "dense":
        # Short runs (memory-only configs) still go through a few topology updates.
        update_every = min(args.update_every, max(2, args.steps // 4))
        sched = snack.dst.DSTScheduler(model, opt, algorithm=args.algorithm, update_every=update_every,
                                       end=int(0.75 * args.steps), drop_fraction=0.3,
                                       generator=torch.Generator(device=device).manual_seed(args.seed))
    data = batches(corpus, args, device, torch.Generator().manual_seed(args.seed))
    evaluation = heldout_batches(heldout, args, device)
    # The peak of each step (the evaluations' batches are no part of it), the steps before a
    # topology update (where RigL captures its inputs) kept apart.
    losses, times, heldout_curve, peaks = [], [], [], {False: 0, True: 0}
    for step in range(args.steps):
        x, y = next(data)
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        update = sched is not None and sched.is_update_step(step + 1)
        t0 = time.perf_counter()
        loss = train_step(model, opt, x, y, dtype)
        sync()
        times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peaks[update] = max(peaks[update], torch.cuda.max_memory_allocated())
        losses.append(loss.item())
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.steps:
            heldout_curve.append((step + 1, heldout_perplexity(model, evaluation, dtype)))
        if (step + 1) % max(1, args.steps // 5) == 0:
            ppl = f"  held-out ppl {heldout_curve[-1][1]:.3f}" if heldout_curve and heldout_curve[-1][0] == step + 1 else ""
            print(f"  [{impl} {dtype}] step {step + 1:5d}  loss {losses[-1]:.4f}{ppl}")
    def mib(peak):
        return (peak - base) / 2**20 if device.type == "cuda" and peak > 0 else float("nan")
    del loss  # the last step's autograd graph: kept alive, it would break the CUDA-graph capture
    step_ms = 1e3 * statistics.median(times[len(times) // 4:] or times)
    if sched is not None:
        sched.remove()  # its hooks on the layers would keep it, and the optimizer state, alive
    del opt, sched
    graph_ms = graphed_step_ms(model, x, y, args.lr, dtype) if device.type == "cuda" else float("nan")
    # Inference: drop training state (snack's patterns keep only what the forward reads), then
    # greedy generation at batch 1 with the KV cache.
    model.eval()
    for p in model.parameters():
        p.grad = None
    if dtype == "bf16":
        # Served as a model trained in mixed precision is: its weights in bf16, read as they are at
        # every token, where autocast would cast every float32 weight again per token.
        model.to(torch.bfloat16)
    if impl == "snack":
        snack.for_inference(model)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before_generation = torch.cuda.memory_allocated()
    prompt = corpus[: min(32, args.block // 2)].long().to(device)[None]
    new_tokens = 8 if args.tiny else 64
    with torch.no_grad():
        # Warm-up over the same lengths: in bf16, cuDNN's attention builds a plan per new key
        # length (~3 ms each on the H200), which the first model of a process would pay alone.
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync()
    gen_ms = 1e3 * (time.perf_counter() - t0) / new_tokens
    # Inference memory: the model's weights and indices plus what generation allocates (not the
    # library workspaces a previous run left allocated).
    model_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    infer = ((model_bytes + torch.cuda.max_memory_allocated() - before_generation) / 2**20
             if device.type == "cuda" else float("nan"))
    row = dict(impl=impl, dtype=dtype, batch=args.batch, block=args.block, sparsity=args.sparsity, steps=args.steps,
               peak_mib=mib(max(peaks.values())), peak_update_mib=mib(peaks[True]), step_ms=step_ms, graph_step_ms=graph_ms,
               tokens_per_s=args.batch * args.block / (step_ms / 1e3),
               final_loss=sum(losses[-5:]) / len(losses[-5:]), heldout_ppl=heldout_curve[-1][1],
               gen_ms_per_token=gen_ms, infer_mib=infer)
    del model  # collected at the start of the next run
    return row, losses, heldout_curve


def graphed_step_ms(model, x, y, lr, dtype: str = "fp32", reps: int = 20) -> float:
    """Median GPU time (ms) of one training step replayed from a CUDA graph, NaN if it cannot be captured.

    A fresh AdamW(capturable=True) keeps its step count on the GPU, as capture requires; the
    weights move, which no longer matters once the training run has been recorded."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, capturable=True)
    x, y = x.clone(), y.clone()
    try:
        graph = benchmark.capture_graph(lambda: train_step(model, opt, x, y, dtype))
    except Exception as exc:  # a host synchronisation inside the model's forward, for example
        print(f"  CUDA-graph capture failed: {type(exc).__name__}: {str(exc)[:200]}")
        torch.cuda.synchronize()
        return float("nan")
    times = benchmark.replay_times_ms(graph, reps)
    del graph, opt
    for p in params:
        p.grad = None
    return statistics.median(times)


def parse_configs(text: str, default_steps: int):
    """'1x128:0.9,8x1024:0.95:20' -> [(1, 128, 0.9, default_steps), (8, 1024, 0.95, 20)]"""
    configs = []
    for item in text.split(","):
        try:
            parts = item.split(":")
            if len(parts) not in (2, 3):
                raise ValueError(item)
            batch, block = parts[0].lower().split("x")
            steps = int(parts[2]) if len(parts) == 3 else default_steps
            configs.append((int(batch), int(block), float(parts[1]), steps))
        except ValueError:
            raise SystemExit(f"--configs: cannot read {item!r}; expected BATCHxBLOCK:SPARSITY[:STEPS], e.g. 1x128:0.9")
        if not 0.0 < configs[-1][2] < 1.0 or configs[-1][3] < 1:
            raise SystemExit(f"--configs: {item!r}: sparsity must be in (0, 1) and steps >= 1")
    return configs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", default="all", choices=["all", "snack", "dense_mask", "dense"])
    parser.add_argument("--algorithm", default="set", choices=["set", "rigl"])
    parser.add_argument("--configs", default="1x128:0.9",
                        help="comma-separated BATCHxBLOCK:SPARSITY[:STEPS] runs (default 1x128:0.9, --steps steps)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--update-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", default="fp32", help="fp32, bf16 (autocast) or both: fp32,bf16")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="held-out perplexity every this many steps (0: at the end only)")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches of max(batch, 8) sequences")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide GPT-2 (tests)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results on a GPU)")
    parser.add_argument("--tag", default="", help="suffix of the result files' names (gpt2_<gpu>_<tag>.*)")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("examples/gpt2_dst.py needs transformers (pip install transformers)")
        return 1
    device = torch.device(args.device)
    configs = parse_configs(args.configs, args.steps)
    if args.eval_every < 0 or args.eval_batches < 1:
        raise SystemExit("--eval-every must be >= 0 and --eval-batches >= 1")
    corpus, heldout = load_corpus(2_000_000 if not args.tiny else 200_000)
    print(f"corpus: {corpus.numel():,} bytes of Python standard-library source for training, {heldout.numel():,} "
          f"held out (every {HELDOUT_EVERY}th file); device {device}")
    impls = ["snack", "dense_mask", "dense"] if args.impl == "all" else [args.impl]
    dtypes = args.dtypes.split(",")
    if not dtypes or any(d not in ("fp32", "bf16") for d in dtypes):
        raise SystemExit(f"--dtypes: {args.dtypes!r}: use fp32, bf16 or fp32,bf16")
    rows, curves, heldout_curves = [], {}, {}
    out = benchmark.results_folder(args.out, device)
    info = benchmark.provenance(device)
    info["run"] = (f"GPT-2 {'tiny' if args.tiny else 'small'}, {args.algorithm}, steps per config as listed, "
                   f"update every {args.update_every} steps (runs under {4 * args.update_every} steps: every "
                   f"steps // 4), AdamW lr {args.lr}, corpus stdlib sources")
    stem = None if out is None else out / (f"gpt2_{benchmark.gpu_slug(device)}" + (f"_{args.tag}" if args.tag else ""))
    for batch, block, sparsity, steps in configs:
        args.batch, args.block, args.sparsity, args.steps = batch, block, sparsity, steps
        print(f"== batch {batch} x block {block}, sparsity {sparsity:g}, {steps} steps")
        for dtype in dtypes:
            for impl in impls:
                row, losses, heldout_curve = run(impl, args, corpus, heldout, device, dtype)
                rows.append(row)
                curves[(batch, block, sparsity, steps, dtype, impl)] = losses
                heldout_curves[(batch, block, sparsity, steps, dtype, impl)] = heldout_curve
                if stem is not None:  # after every run: a run cut off keeps the ones before it
                    benchmark.write_csv(stem.with_suffix(".csv"), info, COLUMNS, rows)
                    _report(stem, rows, curves, heldout_curves, info)
    print(f"\n{'impl':<12}{'dtype':>6}{'config':>14}{'peak MiB':>10}{'step ms':>9}{'graph ms':>9}{'tok/s':>9}{'loss':>8}"
          f"{'ppl':>8}{'gen ms/tok':>11}{'infer MiB':>10}")
    for r in rows:
        config = f"{r['batch']}x{r['block']}:{r['sparsity']:g}"
        print(f"{r['impl']:<12}{r['dtype']:>6}{config:>14}{r['peak_mib']:>10.1f}{r['step_ms']:>9.2f}{r['graph_step_ms']:>9.2f}"
              f"{r['tokens_per_s']:>9.0f}{r['final_loss']:>8.4f}{r['heldout_ppl']:>8.3f}{r['gen_ms_per_token']:>11.2f}"
              f"{r['infer_mib']:>10.1f}")
    return 0


def _report(stem: Path, rows, curves, heldout_curves, info) -> None:
    lines = benchmark.markdown_head("GPT-2 dynamic sparse training", info)
    lines += ["Step ms: wall time of an eager step; graph ms: GPU time of the same step replayed from a CUDA graph. "
              f"Held-out ppl: perplexity (bytes) after the last step on files kept out of training (every "
              f"{HELDOUT_EVERY}th source file).", "",
              "Peak MiB: the largest allocation of any training step above what was allocated before the model "
              "was built; update-step MiB: the same over the steps before a topology update.", "",
              "Gen ms/token: batch-1 greedy generation with the KV cache after training, the model's weights in "
              "the row's dtype (bf16 rows: converted to bf16, no autocast); inference MiB: those weights and "
              "indices plus what generation allocates.", "",
              "| config | dtype | steps | impl | peak MiB | update-step MiB | step ms | graph ms | tokens/s | final loss | "
              "held-out ppl | gen ms/token | inference MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']}x{r['block']} s={r['sparsity']:g} | {r['dtype']} | {r['steps']} | {r['impl']} | "
                     f"{r['peak_mib']:.1f} | {r['peak_update_mib']:.1f} | "
                     f"{r['step_ms']:.2f} | {r['graph_step_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['final_loss']:.4f} | "
                     f"{r['heldout_ppl']:.3f} | {r['gen_ms_per_token']:.2f} | {r['infer_mib']:.1f} |")
    # A config is (batch, block, sparsity, steps, dtype): the same shape may be run for different
    # lengths and precisions.
    configs = sorted({(r["batch"], r["block"], r["sparsity"], r["steps"], r["dtype"]) for r in rows})
    by = {(r["batch"], r["block"], r["sparsity"], r["steps"], r["dtype"], r["impl"]): r for r in rows}
    lines += ["", "## snack against Dense+Mask DST", "",
              "Targets (1x128, 90%): peak memory >= 50% less, final loss within 2%, step time no slower.", "",
              "| config | peak memory | final loss | held-out ppl | eager step | graph step |", "|---|---|---|---|---|---|"]
    for c in configs:
        s, d = by.get(c + ("snack",)), by.get(c + ("dense_mask",))
        if s is None or d is None:
            continue
        lines.append(f"| {c[0]}x{c[1]} s={c[2]:g}, {c[3]} steps, {c[4]} | {100 * (1 - s['peak_mib'] / d['peak_mib']):.0f}% less | "
                     f"{100 * (s['final_loss'] / d['final_loss'] - 1):+.2f}% | "
                     f"{100 * (s['heldout_ppl'] / d['heldout_ppl'] - 1):+.2f}% | {d['step_ms'] / s['step_ms']:.2f}x faster | "
                     f"{d['graph_step_ms'] / s['graph_step_ms']:.2f}x faster |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plt = benchmark.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    first = configs[0]
    for (b, t, sp, st, dt, impl), losses in curves.items():
        if (b, t, sp, st, dt) == first:
            axes[0].plot(losses, label=impl)
            steps, ppl = zip(*heldout_curves[(b, t, sp, st, dt, impl)])
            axes[2].plot(steps, ppl, marker="o" if len(steps) < 30 else None, label=impl)
    axes[0].set_title(f"loss, {first[0]}x{first[1]}, sparsity {first[2]:g}, {first[4]}")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend()
    axes[2].set_title(f"held-out perplexity, {first[0]}x{first[1]}, sparsity {first[2]:g}, {first[4]}")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("perplexity (bytes)")
    axes[2].legend()
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        axes[1].bar([j + i * width for j in range(len(configs))],
                    [by[c + (impl,)]["peak_mib"] if c + (impl,) in by else 0 for c in configs], width, label=impl)
    axes[1].set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(configs))],
                       [f"{c[0]}x{c[1]} {c[4]}\ns={c[2]:g}, {c[3]} st." for c in configs])
    axes[1].set_ylabel("peak training MiB")
    if all(r["peak_mib"] > 0 for r in rows):  # NaN on a CPU
        axes[1].set_yscale("log")
    axes[1].legend()
    fig.suptitle(f"GPT-2 DST - {info['gpu']}, commit {info['commit'][:10]}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
