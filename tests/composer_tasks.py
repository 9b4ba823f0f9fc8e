"""The composer runs of the suite, written once: the task suite's files (``deploy/data/composer-tasks``), the
tiny character-level Llama that spells their prompts, and the three-channel ``[composer]`` table over them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS = Path(__file__).resolve().parents[1] / "deploy" / "data" / "composer-tasks"
ALPHABET = " -.0123456789:=ATabcdefghilmnoprstvwx"
# ``model.tiny``: every character of the tasks' prompts and answers is a token.
TINY_CHARS: dict[str, Any] = {
    "tokenizer": "chars",
    "alphabet": ALPHABET,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 2,
    "num_heads": 4,
}


def composer(
    group_size: int, prompts_per_step: int, max_new_tokens: int, pairs_per_step: int
) -> dict[str, Any]:
    """All three channels: GRPO on the tasks' prompts, SDPO (alpha 1), DPO on their pairs (beta 1).

    A fresh model almost never gets an answer right; the format reward (a digit anywhere, about one completion
    in four) makes the GRPO groups' rewards differ from the first step."""
    return {
        "alpha": 1.0,
        "beta": 1.0,
        "data": {
            "prompts": str(TASKS / "train.jsonl"),
            "heldout": str(TASKS / "heldout.jsonl"),
            "pairs": str(TASKS / "pairs.jsonl"),
        },
        "rewards": [{"fn": "exact_match"}, {"fn": "format", "pattern": ".*[0-9].*", "weight": 0.5}],
        "rollout": {
            "group_size": group_size,
            "prompts_per_step": prompts_per_step,
            "max_new_tokens": max_new_tokens,
        },
        "replay": {"pairs_per_step": pairs_per_step},
    }
