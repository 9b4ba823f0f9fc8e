"""The composer objective on episodes as the trainer runs it: in micro-batches (the same gradient as the whole
batch, on the simulated accelerator) and on a replica of 2 FSDP ranks (CPU processes over gloo), where each
rank runs the episodes of its share of the replica's prompts and the ranks take the step one rank takes.

The model's turns are written by a scripted engine whose answer depends only on an episode's own tokens, so
the episodes do not depend on which rank runs them or what else is in its batch; everything else (the
environment class loaded from its import path, the tool calls, the error sites and their hints, the loss
masks, the counts summed over the ranks) is the production path. The environment owns the reward alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import validate_config
from composer_serverless.models.loading import char_tokenizer
from composer_serverless.objectives import composer as composer_module
from composer_serverless.objectives.engines import Request
from composer_serverless.objectives.objective import make_objective
from tests.environments.conftest import TOOL_CHATML
from tests.environments.test_episode_loss import tiny_llama
from tests.replicas.test_micro_batches import assert_same_gradients, step_gradients

LOSS_TYPES = ("dapo", "grpo")
LOSSES = ("loss/total", "grpo/loss", "sdpo/loss")
# The turns each episode of a group writes first (its k-th row): two calls that count, one the tool refuses
# (an error site, the tool raised) and one that is not JSON (an error site, a malformed call); then "done".
FIRST_TURNS = [
    '<tool_call>{"name": "bump", "arguments": {"by": 1}}</tool_call>',
    '<tool_call>{"name": "bump", "arguments": {"by": 2}}</tool_call>',
    '<tool_call>{"name": "bump", "arguments": {"by": -1}}</tool_call>',
    "<tool_call>{oops</tool_call>",
]


class Counter:
    """An environment class as a user writes one (TRL's environment_factory): its reward is its count."""

    def __init__(self) -> None:
        self.count = 0

    def reset(self, **row: Any) -> None:
        self.count = 0

    def bump(self, by: int) -> str:
        """Add to the count.

        Args:
            by: how much
        """
        if by < 0:
            raise ValueError("only up")
        self.count += by
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count)


def tokenizer() -> Any:
    out = char_tokenizer()
    out.chat_template = TOOL_CHATML
    return out


class ScriptedTurns:
    """An engine whose turn for an episode depends only on the episode's tokens: its first turn is
    ``FIRST_TURNS[k]`` for the k-th of the identical prefixes in the request (the k-th episode of a group),
    every later turn ``done``. Counts the episodes it started in this process (``started``)."""

    name = "scripted-turns"
    started = 0

    def __init__(self) -> None:
        self.tokenizer = tokenizer()

    def complete(self, model: torch.nn.Module, request: Request) -> list[list[int]]:
        rows = []
        for i, prefix in enumerate(request.prompts):
            first = self.tokenizer.decode(prefix).count("<|assistant|>") == 1
            k = sum(list(p) == list(prefix) for p in request.prompts[:i])
            text = FIRST_TURNS[k] if first else "done"
            ScriptedTurns.started += first
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            rows.append(ids[: request.max_new_tokens])
        return rows


def _scripted(*args: Any) -> ScriptedTurns:
    return ScriptedTurns()


def write_data(root: Path) -> dict[str, str]:
    data = {}
    for name, count in (("prompts", 8), ("heldout", 2)):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(count)))
        data[name] = str(path)
    return data


def _config(data: dict[str, str], ranks: int, loss_type: str, micro: int | None) -> Any:
    return validate_config(
        {
            "model": {"tiny": {"tokenizer": "chars"}},
            "train": {"objective": "composer", "micro_batch_size": micro},
            "diloco": {"replicas": 1, "sync_every": 2, "rounds": 1},
            "eval": {"sequences": 2},
            "composer": {
                "alpha": 1.0,
                "beta": 0.0,
                "data": data,
                "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 80},
                "grpo": {"loss_type": loss_type},
                "episodes": {
                    "environment": "tests.environments.test_episode_ranks:Counter",
                    "max_turns": 3,
                    "max_tokens": 200,
                },
            },
            "executor": {"threads_per_replica": 1, "ranks_per_replica": ranks},
        }
    )


def _steps(data: dict[str, str], ranks: int, micro: int | None, device: str, node: Any = None) -> dict:
    """Per loss type: the whole gradient of one composer step on episodes and its summed metrics, on this
    rank."""
    from composer_serverless.replicas.shards import shard_model

    out = {}
    for loss_type in LOSS_TYPES:
        model = tiny_llama(tokenizer()).to(device)
        if ranks > 1:
            shard_model(model, ranks, torch.device(device))
        objective = make_objective(
            _config(data, ranks, loss_type, micro), tokenizer(), 0, model=model, node=node
        )
        ScriptedTurns.started = 0
        grads, metrics, parts = step_gradients(objective, model)
        full = {name: g.full_tensor() if hasattr(g, "full_tensor") else g for name, g in grads.items()}
        out[loss_type] = {
            "grads": {n: g.cpu() for n, g in full.items()},
            "metrics": metrics,
            "parts": parts,
            "started": ScriptedTurns.started,
        }
    return out


def _check_episodes(step: dict) -> None:
    """The step ran the scripted episodes: every group's rewards differ, two of four first turns are error
    sites, and the SDPO term is on (the hints at the sites)."""
    metrics = step["metrics"]
    assert metrics["rollout/frac_zero_std"] == 0, "GRPO's gradient would be zero"
    assert metrics["rollout/tool_errors"] == pytest.approx(0.5) and metrics["rollout/turns"] == 2
    assert metrics["sdpo/loss"] > 0


def test_episodes_in_micro_batches_take_the_whole_batchs_step_on_the_simulated_accelerator(
    tmp_path: Path, monkeypatch
) -> None:
    """16 episodes a step in micro-batches of 3: the gradient and the losses of the whole batch."""
    monkeypatch.setattr(composer_module, "make_engine", _scripted)
    data = write_data(tmp_path)
    with simulated():
        whole = _steps(data, 1, None, "cuda")
        parts = _steps(data, 1, 3, "cuda")
    for loss_type in LOSS_TYPES:
        a, b = whole[loss_type], parts[loss_type]
        _check_episodes(a)
        assert (a["parts"], b["parts"]) == (1, 6)  # ceil(16 / 3)
        assert_same_gradients(b["grads"], a["grads"])
        for name in LOSSES:
            assert b["metrics"][name] == pytest.approx(a["metrics"][name], abs=1e-5), (loss_type, name)


def _rank(local_rank: int, rendezvous: str, data: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from composer_serverless.replicas.node import Node

    torch.set_num_threads(1)
    composer_module.make_engine = _scripted  # this process is the test's own
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=local_rank, world_size=2)
    node = Node(local_rank, 2, dist.new_group(backend="gloo"))
    steps = _steps(data, 2, 3, "cpu", node)
    for step in steps.values():  # each rank's is its share times G: their mean is the replica's
        means = node.sum([step["metrics"][name] for name in LOSSES])
        step["metrics"].update({name: value / 2 for name, value in zip(LOSSES, means, strict=True)})
        step["started"] = [step["started"], *node.sum([float(step["started"])])]  # this rank's, the sum
    if local_rank == 0:
        torch.save(steps, out)
    dist.barrier()  # neither rank leaves gloo while the other may be in a collective
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_run_their_share_of_the_episodes_and_take_the_step_one_rank_takes(
    tmp_path: Path, monkeypatch
) -> None:
    """Each of 2 FSDP ranks runs the 8 episodes of its 2 prompts, in micro-batches of 3: the gradient the
    ranks leave in the sharded model, gathered, and the losses are one rank's running all 16."""
    import torch.multiprocessing as mp

    monkeypatch.setattr(composer_module, "make_engine", _scripted)
    data = write_data(tmp_path)
    one = _steps(data, 1, 3, "cpu")
    out = tmp_path / "two.pt"
    mp.start_processes(
        _rank, args=(str(tmp_path / "rendezvous"), data, str(out)), nprocs=2, join=True, start_method="spawn"
    )
    two = torch.load(out)
    for loss_type in LOSS_TYPES:
        a, b = one[loss_type], two[loss_type]
        _check_episodes(a)
        assert a["started"] == 16 and b["started"] == [8, 16.0]  # 8 episodes on each rank, 16 on one
        assert a["grads"].keys() == b["grads"].keys() and a["grads"]
        for name in a["grads"]:
            torch.testing.assert_close(b["grads"][name], a["grads"][name], rtol=1e-4, atol=1e-6, msg=name)
        for name in LOSSES:
            assert b["metrics"][name] == pytest.approx(a["metrics"][name], rel=1e-4, abs=1e-6), (
                loss_type,
                name,
            )
