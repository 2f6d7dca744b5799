"""The main job: train a truly sparse MLP on a real dataset, and compare it with its dense twin.

    python -m snack.demo [--density 0.1] [--epochs 40] [--hidden 1024] [--device cuda|cpu] [--dst set|rigl]

The dataset is scikit-learn's handwritten digits (1797 8x8 images, 10 classes), which ships inside
the scikit-learn package: nothing is downloaded. The script prints test accuracy, the memory of
parameters + gradients + optimizer state + sparse indices, and the time per training step, for the
sparse model and a dense model of the same architecture.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

import snack


def load_digits_split(device: torch.device, seed: int = 0):
    """Standardised digits, split 80/20 with a fixed permutation."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise SystemExit("snack.demo needs scikit-learn (pip install 'snack[demo]')") from exc
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_train = int(0.8 * x.shape[0])
    mean, std = x[:n_train].mean(0), x[:n_train].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return (x[:n_train].to(device), y[:n_train].to(device)), (x[n_train:].to(device), y[n_train:].to(device))


def make_mlp(in_features: int, hidden: int, classes: int, density: Optional[float], device, seed: int) -> nn.Sequential:
    """in -> hidden -> hidden -> classes, ReLU between; SparseLinear layers when density is given."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    def linear(i, o):
        if density is None:
            return nn.Linear(i, o, device=device)
        return snack.SparseLinear(i, o, density=density, device=device, generator=gen)

    return nn.Sequential(linear(in_features, hidden), nn.ReLU(), linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes, device=device))


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, their gradients, optimizer state and buffers (sparse indices and views)."""
    total = 0
    for p in model.parameters():
        total += p.nbytes + (p.grad.nbytes if p.grad is not None else 0)
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value):
                total += value.nbytes
    total += sum(b.nbytes for b in model.buffers())
    return total


@dataclass
class RunResult:
    name: str
    accuracy: float
    state_bytes: int
    step_ms: float
    weights: int


StepHook = Callable[[int, nn.Module, torch.optim.Optimizer], None]


def train(name: str, model: nn.Module, train_set, test_set, *, epochs: int, batch: int, lr: float, seed: int,
          log_every: int = 10, after_step: Optional[StepHook] = None, dst: Optional[str] = None) -> RunResult:
    """AdamW training with a fixed batch order; `after_step(step, model, optimizer)` runs after each
    optimizer step. `dst` ("set" or "rigl") attaches a snack.dst.DSTScheduler to the optimizer."""
    x_train, y_train = train_set
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = None
    if dst is not None:
        steps_per_epoch = (x_train.shape[0] + batch - 1) // batch
        scheduler = snack.dst.DSTScheduler(model, optimizer, algorithm=dst, update_every=max(1, steps_per_epoch // 2),
                                           end=int(0.75 * epochs * steps_per_epoch), drop_fraction=0.3,
                                           generator=torch.Generator(device=x_train.device).manual_seed(seed))
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(seed)
    sync = torch.cuda.synchronize if x_train.is_cuda else (lambda: None)
    step, step_time, timed_steps = 0, 0.0, 0
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(x_train.shape[0], generator=gen).to(x_train.device)
        for start in range(0, x_train.shape[0], batch):
            idx = order[start:start + batch]
            sync()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            sync()
            if epoch > 0:  # the first epoch includes one-time start-up costs
                step_time += time.perf_counter() - t0
                timed_steps += 1
            if after_step is not None:
                after_step(step, model, optimizer)
            step += 1
        if (epoch + 1) % log_every == 0 or epoch + 1 == epochs:
            moved = f"  moved {sum(r['moved'] for r in scheduler.report())}" if scheduler is not None else ""
            print(f"  [{name}] epoch {epoch + 1:3d}  loss {loss.item():.4f}  test acc {evaluate(model, test_set):.2%}"
                  f"{moved}")
    weights = sum(m.nnz if isinstance(m, (snack.SparseLinear, snack.dst.DenseMaskLinear)) else m.weight.numel()
                  for m in model.modules() if isinstance(m, (snack.SparseLinear, snack.dst.DenseMaskLinear, nn.Linear)))
    return RunResult(name, evaluate(model, test_set), training_state_bytes(model, optimizer),
                     1e3 * step_time / max(1, timed_steps), weights)


@torch.no_grad()
def evaluate(model: nn.Module, test_set) -> float:
    model.eval()
    x, y = test_set
    return (model(x).argmax(1) == y).float().mean().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--density", type=float, default=0.1, help="fraction of hidden connections kept (default 0.1)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden width (default 1024)")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense comparison run")
    parser.add_argument("--dst", choices=["set", "rigl"], default=None,
                        help="dynamic sparse training: prune and regrow 30%% (cosine-decayed) twice per epoch")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    train_set, test_set = load_digits_split(device, args.seed)
    print(f"snack demo on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}): "
          f"digits, {train_set[0].shape[0]} train / {test_set[0].shape[0]} test, MLP 64-{args.hidden}-{args.hidden}-10")
    common = dict(epochs=args.epochs, batch=args.batch, lr=args.lr, seed=args.seed, log_every=max(1, args.epochs // 4))
    label = f"sparse d={args.density:g}" + (f" {args.dst}" if args.dst else "")
    results = [train(label, make_mlp(64, args.hidden, 10, args.density, device, args.seed), train_set, test_set,
                     dst=args.dst, **common)]
    if args.dst:
        # The Dense+Mask reference of the same DST run: same initial weights and masks, same rule and seed.
        reference = make_mlp(64, args.hidden, 10, args.density, device, args.seed)
        for i, module in enumerate(reference):
            if isinstance(module, snack.SparseLinear):
                reference[i] = snack.dst.DenseMaskLinear.from_sparse(module)
        results.append(train(f"dense+mask {args.dst}", reference, train_set, test_set, dst=args.dst, **common))
    if not args.no_dense:
        results.append(train("dense", make_mlp(64, args.hidden, 10, None, device, args.seed), train_set, test_set,
                             **common))

    print(f"\n{'model':<16}{'test acc':>10}{'weights':>12}{'params+grads+optim+indices':>30}{'ms/step':>10}")
    for r in results:
        print(f"{r.name:<16}{r.accuracy:>10.2%}{r.weights:>12,}{r.state_bytes / 2**20:>26.2f} MiB{r.step_ms:>10.3f}")
    sparse, dense = results[0], results[-1]
    if dense.name == "dense":
        print(f"\nsparse training state is {1 - sparse.state_bytes / dense.state_bytes:.1%} smaller than dense; "
              f"accuracy {sparse.accuracy - dense.accuracy:+.2%} points")
    if args.dst:
        ref = results[1]
        print(f"snack {args.dst} vs its Dense+Mask reference: accuracy {sparse.accuracy - ref.accuracy:+.2%} points, "
              f"training state {1 - sparse.state_bytes / ref.state_bytes:.1%} smaller")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
