"""The live-harvest run the tests and ``benchmarks/harvest_live.py`` launch, written once: a 2-replica composer
run of the task suite's tiny character-level model that takes its replay pairs from teachers harvested live."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from composer_serverless.config import RunConfig, validate_config
from tests.composer_tasks import TASKS, TINY_CHARS


def composer_live_config(
    teachers: list[dict[str, Any]], store: Path, run_id: str, rounds: int, **harvest: Any
) -> RunConfig:
    """``teachers`` are ``[[harvest.teachers]]`` tables; ``harvest`` sets the other ``[harvest]`` keys."""
    return validate_config(
        {
            "run_id": run_id,
            "store": str(store),
            "model": {"tiny": TINY_CHARS},
            "train": {"objective": "composer", "lr": 1e-3},
            "diloco": {"replicas": 2, "sync_every": 8, "rounds": rounds},
            "eval": {"sequences": 7},
            "composer": {
                "alpha": 0.0,
                "beta": 1.0,
                "data": {"prompts": str(TASKS / "train.jsonl"), "heldout": str(TASKS / "heldout.jsonl")},
                "rewards": [{"fn": "exact_match"}],
                "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
                "replay": {"pairs_per_step": 4},
            },
            "harvest": {"live": True, "max_usd": 1.0, "teachers": teachers, **harvest},
            "executor": {"type": "local", "threads_per_replica": 1},
        }
    )
