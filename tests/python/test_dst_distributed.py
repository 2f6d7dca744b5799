"""DDP: every rank ends each topology update with the same pattern (two CPU processes, gloo)."""

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


def _worker(rank: int, world: int, port: int, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import snack

        torch.manual_seed(0)  # same initial model on every rank
        layer = snack.SparseLinear(32, 16, density=0.25)
        inner = nn.Sequential(layer)
        snack.prepare_ddp(inner)
        model = nn.parallel.DistributedDataParallel(inner)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        # Different generators per rank: without agreement the ranks would grow different positions.
        sched = snack.dst.DSTScheduler(model, opt, algorithm="rigl", update_every=2, drop_fraction=0.3,
                                       drop_schedule="constant", generator=torch.Generator().manual_seed(rank))
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(4, 32, generator=data)).square().mean().backward()
            opt.step()
        torch.save({"rows": layer.row_idx, "cols": layer.col_idx, "values": layer.values.detach(),
                    "moved": sum(r["moved"] for r in sched.report())}, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_ddp_ranks_keep_identical_topology(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["moved"] > 0
    assert torch.equal(r0["rows"], r1["rows"]) and torch.equal(r0["cols"], r1["cols"])
    assert torch.allclose(r0["values"], r1["values"])
