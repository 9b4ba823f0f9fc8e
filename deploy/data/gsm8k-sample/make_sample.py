"""Write a small GSM8K-shaped sample of grade-school math word problems: the project's own problems, in
GSM8K's columns and answer format (``question``; ``answer`` with the worked solution, calculator annotations
``<<a+b=c>>`` and the final ``#### N``), so the math recipe runs offline and a GSM8K user's reward code works
on it unchanged.

    python deploy/data/gsm8k-sample/make_sample.py deploy/data/gsm8k-sample
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

NAMES = (
    "Natalia",
    "Weng",
    "Betty",
    "Julie",
    "James",
    "Mark",
    "Albert",
    "Ken",
    "Alexis",
    "Tina",
    "Randy",
    "Joy",
)
ITEMS = ("clips", "books", "apples", "stamps", "marbles", "cookies", "pencils", "shells")


def _halves(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    first = 2 * rng.randrange(6, 60)
    second = first // 2
    question = (
        f"{name} sold {item} to {first} of their friends in April, and then sold half as many {item} in May. "
        f"How many {item} did {name} sell altogether in April and May?"
    )
    answer = (
        f"{name} sold {first}/2 = <<{first}/2={second}>>{second} {item} in May.\n"
        f"{name} sold {first}+{second} = <<{first}+{second}={first + second}>>{first + second} {item} altogether.\n"
        f"#### {first + second}"
    )
    return question, answer


def _wage(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    rate, minutes = rng.randrange(6, 30), 5 * rng.randrange(2, 12)
    cents = rate * minutes
    total = cents / 60
    if cents % 60:
        return _wage(rng)
    question = f"{name} earns ${rate} an hour for babysitting. Yesterday, {name} did {minutes} minutes of babysitting. How much did {name} earn?"
    answer = (
        f"{name} earns {rate}/60 dollars per minute.\n"
        f"Working {minutes} minutes, {name} earned {rate}/60 * {minutes} = <<{rate}/60*{minutes}={int(total)}>>{int(total)} dollars.\n"
        f"#### {int(total)}"
    )
    return question, answer


def _savings(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(("wallet", "bike", "game", "jacket"))
    price = 10 * rng.randrange(5, 20)
    has = price // 2
    parents = rng.randrange(5, has)
    grandparents = 2 * parents
    left = price - has - parents - grandparents
    if left <= 0:
        return _savings(rng)
    question = (
        f"{name} is saving money for a new {item} which costs ${price}. {name} has only half of the money needed. "
        f"Their parents decided to give ${parents} for that purpose, and their grandparents twice as much as the "
        f"parents. How much more money does {name} need to buy the {item}?"
    )
    answer = (
        f"In the beginning, {name} has only {price} / 2 = $<<{price}/2={has}>>{has}.\n"
        f"The grandparents gave {parents} * 2 = $<<{parents}*2={grandparents}>>{grandparents}.\n"
        f"{name} needs {price} - {has} - {parents} - {grandparents} = $<<{price}-{has}-{parents}-{grandparents}={left}>>{left} more.\n"
        f"#### {left}"
    )
    return question, answer


def _pages(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    pages, today = 10 * rng.randrange(12, 40), rng.randrange(5, 20)
    yesterday = today
    twice = 2 * today
    read = yesterday + twice
    left = pages - read
    tomorrow = left // 2
    if left <= 0 or left % 2:
        return _pages(rng)
    question = (
        f"{name} is reading a {pages}-page book. Yesterday, {name} was able to read {yesterday} pages and today, "
        f"twice as many pages as yesterday. If {name} wants to read half of the remaining pages tomorrow, how "
        "many pages should they read?"
    )
    answer = (
        f"{name} read {yesterday} x 2 = <<{yesterday}*2={twice}>>{twice} pages today.\n"
        f"So {name} has read {yesterday} + {twice} = <<{yesterday}+{twice}={read}>>{read} pages since yesterday.\n"
        f"There are {pages} - {read} = <<{pages}-{read}={left}>>{left} pages left to be read.\n"
        f"Half of them is {left}/2 = <<{left}/2={tomorrow}>>{tomorrow} pages.\n"
        f"#### {tomorrow}"
    )
    return question, answer


KINDS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (_halves, _wage, _savings, _pages)


def rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        question, answer = KINDS[i % len(KINDS)](rng)
        out.append({"question": question, "answer": answer})
    return out


def main(out: Path) -> None:
    for name, count, seed in (("train.jsonl", 200, 0), ("test.jsonl", 40, 1)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
