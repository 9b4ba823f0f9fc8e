"""Write the data of `make demo-agent`: prompts asking for a safe's code (the code in a column the prompt does
not show, for the environment's ``reset``), and example traces of the episode done right, for the warm start.

    python deploy/data/agent-safe/make_data.py deploy/data/agent-safe

Files: ``train.jsonl`` and ``heldout.jsonl`` (``prompt``, ``code``, ``answer``: the episodes of the RL run and
its held-out success), ``traces.jsonl`` and ``traces-heldout.jsonl`` (``messages`` and ``tools``, TRL's
tool-calling SFT format: the tool call, the tool's answer, the code as the answer; three in four without the
tools, a curriculum: see ``main``). The traces' tool schema is
the one the run's environment gives (read from ``deploy/configs/agent_safe.py`` through the product's loader),
so the warm start reads the prompt the episodes will. A code is one character of 62 (letters and digits), drawn
afresh for every row, so a safe's number says nothing of its code: the warm start teaches the behaviour, not
the answers. Why one character: a tiny model from scratch learns to copy one from the tool's answer within the
demo's budget (after a plateau); four digits stayed guessed (docs/RESULTS.md, section 20).
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

from composer_serverless.environments.tools import EnvironmentFactory

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


SYMBOLS = string.ascii_letters + string.digits


def row(rng: random.Random) -> dict[str, str]:
    code = rng.choice(SYMBOLS)
    return {"prompt": f"What is the code of safe {rng.randrange(1000)}?", "code": code, "answer": code}


def trace(prompt_row: dict[str, str], tools: list[dict] | None) -> dict:
    """The episode done right; without ``tools`` the template leaves out its 600-token tool preamble."""
    call = {"type": "function", "function": {"name": "read_note", "arguments": {}}}
    messages = [
        {"role": "user", "content": prompt_row["prompt"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "read_note", "content": prompt_row["code"]},
        {"role": "assistant", "content": prompt_row["answer"]},
    ]
    return {"messages": messages, "tools": tools} if tools else {"messages": messages}


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(out: Path) -> None:
    tools = EnvironmentFactory.load((), "agent_safe.py:Safe", CONFIGS)().tools
    rng = random.Random(0)
    write(out / "train.jsonl", [row(rng) for _ in range(512)])
    write(out / "heldout.jsonl", [row(rng) for _ in range(32)])
    # A curriculum in the data: most traces short (no tool preamble, ~120 tokens, seven to a row), where
    # copying the code from the tool's answer is learnt in a context of 120 tokens, not 840; a quarter with the
    # preamble, as the episodes' prompts are.
    traces = [trace(row(rng), tools if i % 4 == 0 else None) for i in range(2048)]
    write(out / "traces.jsonl", traces)
    write(out / "traces-heldout.jsonl", [trace(row(rng), tools) for _ in range(16)])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
