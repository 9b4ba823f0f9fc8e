"""The composer demo's offline task suite: small arithmetic and string transforms, made deterministically.

``python -m composer_serverless.data.task_suite OUT_DIR`` writes four JSONL files:

- ``train.jsonl`` / ``heldout.jsonl``: RL prompts ``{prompt, answer, task}`` scored by exact match; the
  held-out arguments of a task never occur in its training prompts. ``digit`` (repeat the one digit among
  two letters, ``digit a7c=`` -> ``7``) is the very easy task: the answer is the only digit in the prompt, so
  no position or arithmetic is needed, yet it changes with every prompt.
- ``traces.jsonl``: frozen traces of a scripted *student* on the training prompts, each with the answers of
  three scripted *teachers* (one careful, one that sometimes repeats the student's typical mistake, one that
  sometimes slips), so that the teachers disagree now and then as real ones do.
- ``pairs.jsonl``: the replay channel's preference pairs: wherever two teachers agree and their answer differs
  from the student's, ``{prompt, chosen: the majority answer, rejected: the student's answer}``.

The files are committed (``deploy/data/composer-tasks``) rather than generated at launch: a run then reads its
data through the same fsspec path a user's data takes, the exact bytes are reviewable in a diff, and a test
regenerates them and compares byte for byte, so the generator cannot drift from what runs train on.
Everything is seeded from strings, and nothing depends on the model, the tokenizer or the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

SEED = "composer-task-suite-v1"
HELDOUT_PER_TASK = 32
TRAIN_PER_TASK = 200
DIGITS = "0123456789"
LETTERS = "abcdef"


@dataclass(frozen=True)
class Task:
    """A task: its argument space, the solution, and the scripted student's typical mistake."""

    name: str
    arguments: Callable[[], list[str]]
    solve: Callable[[str], str]
    mistake: Callable[[str, random.Random], str]


def _strings(alphabet: str, length: int) -> Callable[[], list[str]]:
    return lambda: ["".join(p) for p in product(alphabet, repeat=length)]


def _add(arg: str) -> str:
    a, b = arg.split()
    return str(int(a) + int(b))


def _one_digit_among_letters() -> list[str]:
    """Three characters: one digit, anywhere, and two letters."""
    return sorted(
        "".join(chars[:i] + [d] + chars[i:])
        for d in DIGITS
        for chars in (list(p) for p in product(LETTERS, repeat=2))
        for i in range(3)
    )


TASKS = (
    Task(
        "digit",
        _one_digit_among_letters,
        lambda s: next(c for c in s if c in DIGITS),
        lambda s, rng: rng.choice([c for c in s if c in LETTERS]),
    ),
    Task("first", _strings(DIGITS, 3), lambda s: s[0], lambda s, rng: rng.choice(s[1:])),
    Task("last", _strings(DIGITS, 3), lambda s: s[-1], lambda s, rng: rng.choice(s[:-1])),
    Task("max", _strings(DIGITS, 3), lambda s: max(s), lambda s, rng: rng.choice([min(s), s[0]])),
    Task(
        "add",
        lambda: [f"{a} {b}" for a in range(10) for b in range(10)],
        _add,
        lambda s, rng: str(int(_add(s)) + rng.choice([-1, 1])),
    ),
    Task("reverse", _strings(LETTERS, 3), lambda s: s[::-1], lambda s, rng: rng.choice([s, s[1:] + s[0]])),
    Task(
        "sort",
        _strings(DIGITS, 3),
        lambda s: "".join(sorted(s)),
        lambda s, rng: rng.choice(["".join(sorted(s, reverse=True)), s]),
    ),
)


def prompt(task: str, arg: str) -> str:
    return f"{task} {arg}="


def split(task: Task) -> tuple[list[str], list[str]]:
    """(train, held-out) arguments: disjoint, drawn without replacement in a seeded order."""
    space = task.arguments()
    order = random.Random(f"{SEED}:split:{task.name}").sample(space, len(space))
    heldout = order[:HELDOUT_PER_TASK]
    return order[HELDOUT_PER_TASK : HELDOUT_PER_TASK + TRAIN_PER_TASK], heldout


def _slip(answer: str, rng: random.Random) -> str:
    """A one-character typo of ``answer``."""
    i = rng.randrange(len(answer))
    alphabet = LETTERS if answer[i] in LETTERS else DIGITS
    return answer[:i] + rng.choice([c for c in alphabet if c != answer[i]]) + answer[i + 1 :]


def trace(task: Task, arg: str) -> dict[str, Any]:
    """The student's answer and the three teachers' answers to one prompt, seeded by the prompt."""
    rng = random.Random(f"{SEED}:trace:{task.name}:{arg}")
    right = task.solve(arg)
    student = right if rng.random() < 0.2 else task.mistake(arg, rng)
    careful = right
    hasty = right if rng.random() < 0.8 else task.mistake(arg, rng)
    sloppy = right if rng.random() < 0.75 else _slip(right, rng)
    return {
        "prompt": prompt(task.name, arg),
        "task": task.name,
        "student": student,
        "teachers": {"careful": careful, "hasty": hasty, "sloppy": sloppy},
    }


def majority(answers: Iterable[str]) -> str | None:
    """The answer at least two of the teachers gave, or None when they all differ."""
    answer, votes = Counter(answers).most_common(1)[0]
    return answer if votes >= 2 else None


def pair(record: dict[str, Any]) -> dict[str, str] | None:
    """The preference pair a trace yields: majority answer over the student's, when they differ."""
    chosen = majority(record["teachers"].values())
    if chosen is None or chosen == record["student"]:
        return None
    return {"prompt": record["prompt"], "chosen": chosen, "rejected": record["student"]}


def prefix_credit(completions: list[str], answer: list[str], **columns: Any) -> list[float]:
    """Partial credit for the demo's rewards: the length of the common prefix of each completion and its
    answer, over the longer of the two. 1 only for the exact answer; a fresh model earns some for a right
    first character, which exact match alone (right character and EOS, about 1 / V^2) almost never pays.

    A user reward (``composer_serverless.data.task_suite:prefix_credit``) in TRL's form.
    """
    credits = []
    for completion, expected in zip(completions, answer, strict=True):
        wanted, text = expected.strip(), completion.strip()
        common = next(
            (i for i, (a, b) in enumerate(zip(text, wanted, strict=False)) if a != b),
            min(len(text), len(wanted)),
        )
        credits.append(common / max(len(text), len(wanted), 1))
    return credits


def generate() -> dict[str, list[dict[str, Any]]]:
    """Every file's records, in file order."""
    files: dict[str, list[dict[str, Any]]] = {"train": [], "heldout": [], "traces": [], "pairs": []}
    for task in TASKS:
        train, heldout = split(task)
        files["train"] += [
            {"prompt": prompt(task.name, a), "answer": task.solve(a), "task": task.name} for a in train
        ]
        files["heldout"] += [
            {"prompt": prompt(task.name, a), "answer": task.solve(a), "task": task.name} for a in heldout
        ]
        traces = [trace(task, a) for a in train]
        files["traces"] += traces
        files["pairs"] += [p for p in map(pair, traces) if p is not None]
    return files


def render(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in records).encode("ascii")


def write(out_dir: Path) -> dict[str, int]:
    """Write the suite into ``out_dir``; returns the record count of each file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, records in generate().items():
        (out_dir / f"{name}.jsonl").write_bytes(render(records))
        counts[name] = len(records)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory for train/heldout/traces/pairs.jsonl")
    args = parser.parse_args(argv)
    for name, count in write(args.out_dir).items():
        print(f"{args.out_dir / name}.jsonl: {count} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
