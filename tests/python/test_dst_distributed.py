"""DDP: every rank ends each topology update with the same pattern.

Two processes: on the CPU with gloo (always), and on two GPUs with NCCL (when two are present).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, result_dir: str, backend: str, algorithm: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        import snack

        torch.manual_seed(0)  # same initial model on every rank
        layer = snack.SparseLinear(96, 40, density=0.25, device=device,
                                   generator=torch.Generator(device=device).manual_seed(0))
        inner = nn.Sequential(layer)
        snack.prepare_ddp(inner)
        model = nn.parallel.DistributedDataParallel(inner, device_ids=[rank] if device.type == "cuda" else None)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        # Different generators per rank: without agreement the ranks would grow different positions.
        sched = snack.dst.DSTScheduler(model, opt, algorithm=algorithm, update_every=2, drop_fraction=0.3,
                                       drop_schedule="constant",
                                       generator=torch.Generator(device=device).manual_seed(rank))
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(4, 96, generator=data).to(device)).square().mean().backward()
            opt.step()
        torch.save({"rows": layer.row_idx.cpu(), "cols": layer.col_idx.cpu(), "values": layer.values.detach().cpu(),
                    "exp_avg": opt.state[layer.values]["exp_avg"].cpu(),
                    "moved": sum(r["moved"] for r in sched.report())}, os.path.join(result_dir, f"rank{rank}.pt"))
        # Neither rank tears its group down while the other is still in a collective: gloo aborts the
        # process whose threads are cut off ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _two_gpus_with_nccl() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
@pytest.mark.parametrize("algorithm", ["set", "rigl"])
@pytest.mark.parametrize("backend", [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(not _two_gpus_with_nccl(), reason="needs two GPUs and NCCL")),
])
def test_ddp_ranks_keep_identical_topology(tmp_path, backend, algorithm):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), backend, algorithm), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["moved"] > 0
    assert torch.equal(r0["rows"], r1["rows"]) and torch.equal(r0["cols"], r1["cols"])
    # DDP averages the gradients, so the weights and Adam's moments agree too (to rounding).
    torch.testing.assert_close(r0["values"], r1["values"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(r0["exp_avg"], r1["exp_avg"], rtol=1e-6, atol=1e-7)
