"""The composer objective on a replica of 2 FSDP ranks (CPU processes over gloo) takes the step one rank takes.

Each rank samples its share of the replica's prompts from the whole weights (gathered once), trains on its share
of the rollouts and pairs normalised by the replica's counts, and FSDP averages the ranks' gradients. For the
two replicas to see the same rollouts, sampling here is seeded per prompt (a wrapper around the reference
engine that completes one prompt at a time), so a prompt's completions do not depend on which rank samples it
or what else is in its batch; everything else is the production path.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_serverless.config import validate_config
from composer_serverless.objectives import composer as composer_module
from composer_serverless.objectives.engines import Request
from composer_serverless.objectives.objective import make_objective
from composer_serverless.objectives.rollout import REFERENCE
from tests.composer_tasks import ALPHABET
from tests.replicas.test_composer_objective import HELDOUT, PAIRS, TRAIN
from tests.replicas.test_micro_batches import step_gradients

LOSS_TYPES = ("dapo", "grpo")
LOSSES = ("loss/total", "grpo/loss", "sdpo/loss", "replay/loss")


class PerPromptSeeded:
    """The reference engine, one prompt at a time, each seeded by its tokens and the call's number."""

    name = "per-prompt-seeded"

    def __init__(self) -> None:
        self.calls = 0

    def complete(self, model: torch.nn.Module, request: Request) -> list[list[int]]:
        self.calls += 1
        rows: list[list[int]] = []
        for prompt in request.prompts:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(bytes(prompt)) + self.calls)
                rows += REFERENCE.complete(model, dataclasses.replace(request, prompts=[prompt]))
        return rows


def _seeded(*args: Any) -> PerPromptSeeded:
    return PerPromptSeeded()


def _config(data: dict[str, str], ranks: int, loss_type: str) -> Any:
    return validate_config(
        {
            "model": {
                "tiny": {"tokenizer": "chars", "hidden_size": 32, "intermediate_size": 64, "num_heads": 4}
            },
            "train": {"objective": "composer", "micro_batch_size": 3},
            "diloco": {"replicas": 1, "sync_every": 2, "rounds": 1},
            "eval": {"sequences": 3},
            "composer": {
                "alpha": 1.0,
                "beta": 1.0,
                "data": data,
                "rewards": [{"fn": "exact_match"}, {"fn": "format", "pattern": "[0-9].*", "weight": 0.5}],
                "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
                "grpo": {"loss_type": loss_type},
                "replay": {"pairs_per_step": 4},
            },
            "executor": {"threads_per_replica": 1, "ranks_per_replica": ranks},
        }
    )


def _steps(data: dict[str, str], ranks: int, node: Any = None) -> dict[str, Any]:
    """Per loss type: the whole gradient of one composer step and its summed metrics, on this rank."""
    from composer_serverless.models.loading import char_tokenizer
    from composer_serverless.replicas.shards import shard_model
    from tests.replicas.conftest import tiny_model

    tokenizer = char_tokenizer(ALPHABET)
    out = {}
    for loss_type in LOSS_TYPES:
        model = tiny_model(tokenizer)
        if ranks > 1:
            shard_model(model, ranks, torch.device("cpu"))
        objective = make_objective(_config(data, ranks, loss_type), tokenizer, 0, model=model, node=node)
        torch.manual_seed(5)
        grads, metrics, parts = step_gradients(objective, model)
        full = {name: g.full_tensor() if hasattr(g, "full_tensor") else g for name, g in grads.items()}
        out[loss_type] = {"grads": full, "metrics": metrics, "parts": parts}
    return out


def _rank(local_rank: int, rendezvous: str, data: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from composer_serverless.replicas.node import Node

    torch.set_num_threads(1)
    composer_module.make_engine = _seeded  # this process is the test's own
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=local_rank, world_size=2)
    node = Node(local_rank, 2, dist.new_group(backend="gloo"))
    steps = _steps(data, 2, node)
    for step in steps.values():  # each rank's is its share times G: their mean is the replica's
        means = node.sum([step["metrics"][name] for name in LOSSES])
        step["metrics"].update({name: value / 2 for name, value in zip(LOSSES, means, strict=True)})
    if local_rank == 0:
        torch.save(steps, out)
    dist.barrier()  # neither rank leaves gloo while the other may be in a collective
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_take_the_step_one_rank_takes(tmp_path: Path, jsonl, monkeypatch) -> None:
    """GRPO (token- and sequence-normalised), SDPO from hints and DPO replay, in micro-batches: the gradient
    two ranks leave in the sharded model, gathered, is the one rank's, and so are the losses."""
    import torch.multiprocessing as mp

    data = {
        "prompts": jsonl("train.jsonl", TRAIN),
        "heldout": jsonl("heldout.jsonl", HELDOUT),
        "pairs": jsonl("pairs.jsonl", PAIRS),
    }
    monkeypatch.setattr(composer_module, "make_engine", _seeded)
    one = _steps(data, 1)
    out = tmp_path / "two.pt"
    mp.start_processes(
        _rank, args=(str(tmp_path / "rendezvous"), data, str(out)), nprocs=2, join=True, start_method="spawn"
    )
    two = torch.load(out)
    for loss_type in LOSS_TYPES:
        a, b = one[loss_type], two[loss_type]
        assert a["metrics"]["sdpo/loss"] > 0 and a["metrics"]["replay/loss"] > 0, loss_type
        assert a["metrics"]["rollout/frac_zero_std"] < 1, "GRPO's gradient would be zero"
        assert a["grads"].keys() == b["grads"].keys() and a["grads"]
        for name in a["grads"]:
            torch.testing.assert_close(b["grads"][name], a["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
        for name in LOSSES:
            assert b["metrics"][name] == pytest.approx(a["metrics"][name], rel=1e-4, abs=1e-6), (
                loss_type,
                name,
            )
