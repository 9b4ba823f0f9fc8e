"""Moving whole tensors in and out of FSDP2's shards (``shards.whole_of_shard``, ``shards.shard_of``), as a
decoupled learner of several ranks publishes and adopts: 2 gloo ranks, a parameter whose rows do not split
evenly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

ROWS, COLS = 5, 3  # 5 rows over 2 ranks: FSDP2 cuts dim 0 as torch.chunk does, 3 rows and 2


def _whole() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def _on_rank(local_rank: int, rendezvous: str, out: str) -> None:
    """One of 2 ranks: shard a one-layer model, then scatter a tensor only rank 0 holds and gather the
    rank's shards back; what each rank got goes to ``out``-``local_rank``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from composer_serverless.replicas.shards import local, shard_of, whole_of_shard

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=local_rank, world_size=2)
    model = nn.Linear(COLS, ROWS)
    with torch.no_grad():
        model.weight.copy_(_whole())
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    weight = model.weight
    held = local(weight).detach().clone()  # FSDP2's own shard of the weight
    # A version only rank 0 read from the store: 100 more than the weights.
    scattered = shard_of(_whole() + 100 if local_rank == 0 else None, weight)
    gathered = whole_of_shard(held * 2, weight)
    Path(f"{out}-{local_rank}").write_text(
        json.dumps({"held": held.tolist(), "scattered": scattered.tolist(), "gathered": gathered.tolist()})
    )
    dist.barrier()  # as tests/replicas/test_fsdp.py's helpers: no teardown, the exit status is what counts
    os._exit(0)


def test_a_whole_tensor_scattered_from_rank_0_and_gathered_back(tmp_path: Path) -> None:
    """Rank 0's whole tensor lands as each rank's shard where FSDP2 put that rank's rows of the weight
    (rows 0-2 and 3-4), the other rank passing nothing; and each rank's shards gathered are the whole again,
    on both ranks."""
    import torch.multiprocessing as mp

    out = tmp_path / "ranks"
    mp.start_processes(
        _on_rank, args=(str(tmp_path / "rendezvous"), str(out)), nprocs=2, join=True, start_method="spawn"
    )
    ranks = [json.loads(Path(f"{out}-{r}").read_text()) for r in (0, 1)]
    rows = [[0, 1, 2], [3, 4]]
    whole = _whole()
    for rank, mine in zip(ranks, rows, strict=True):
        assert torch.equal(torch.tensor(rank["held"]), whole[mine])
        assert torch.equal(torch.tensor(rank["scattered"]), whole[mine] + 100)
        assert torch.equal(torch.tensor(rank["gathered"]), whole * 2)
