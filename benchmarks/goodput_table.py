"""A table of decoupled configurations against lock-step at equal tokens, from ``benchmarks/goodput.py`` runs
made apart (``--modes lock-step`` once per seed, ``--modes decoupled --set ...`` per configuration), so that a
comparison of many configurations runs lock-step once:

    python benchmarks/goodput_table.py docs/results/goodput/adopt

reads every ``<dir>/*/results.json`` below it; per scenario and seed, each decoupled run is compared with the
lock-step run of that scenario and seed by ``goodput.at_equal_tokens`` (the benchmark's own comparison), and
the table is printed as markdown and written to ``<dir>/table.json``.

Lock-step runs of several lengths (``--rounds``) for one scenario and seed: the longest is the one compared
as above, and each decoupled run is also compared at the end of both schedules with equal tokens
(``complete_schedules``): its final global against the final global of the longest lock-step run holding no
more tokens than it does. Decoupled's ``rounds`` counts versions, and with a quorum below N its versions hold
fewer tokens than lock-step's rounds; comparing its final with lock-step's final of a shorter run compares two
annealed schedules, and lock-step's fewer-or-equal tokens make the gap conservative for decoupled.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput import at_equal_tokens  # noqa: E402


def table(root: Path) -> list[dict[str, Any]]:
    """One row per decoupled run below ``root``, with its lock-step counterpart's figures."""
    runs = {path.parent.name: json.loads(path.read_text()) for path in sorted(root.glob("*/results.json"))}
    by_length: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs.values():
        for scenario, row in r["results"].items():
            if "lock-step" in row:
                by_length.setdefault((scenario, r["seed"]), []).append(row["lock-step"])
    lock_step = {k: max(v, key=lambda ls: ls["evals"][-1][1]) for k, v in by_length.items()}
    rows = []
    for name, r in runs.items():
        for scenario, row in r["results"].items():
            if "decoupled" not in row or (scenario, r["seed"]) not in lock_step:
                continue
            ours, theirs = row["decoupled"], lock_step[(scenario, r["seed"])]
            compared = at_equal_tokens(theirs["evals"], ours["evals"])
            rows.append(
                {
                    "run": name,
                    "scenario": scenario.split(":")[0],
                    "seed": r["seed"],
                    "set": r["decoupled"].get("set", []),
                    "max_lag": r["decoupled"]["max_lag"],
                    "goodput": ours["goodput"],
                    "lock_step_goodput": theirs["goodput"],
                    "at_equal_tokens": compared,
                    "complete_schedules": complete_schedules(by_length[(scenario, r["seed"])], ours["evals"]),
                    "staleness": ours["staleness"],
                    "merged_steps": ours["merged_steps"],
                    "executed_steps": ours["executed_steps"],
                }
            )
    return rows


def complete_schedules(lock_steps: list[dict[str, Any]], evals: list[list[float]]) -> dict[str, Any] | None:
    """Decoupled's final global (``evals``' last: ``[version, tokens, s, loss]``) against the final global
    of the longest of ``lock_steps`` (runs of one scenario and seed) holding no more tokens; None if every one
    holds more."""
    version, tokens, _, loss = evals[-1][:4]
    shorter = [ls["evals"][-1] for ls in lock_steps if ls["evals"][-1][1] <= tokens]
    if not shorter:
        return None
    rounds, ls_tokens, _, ls_loss = max(shorter, key=lambda e: e[1])[:4]
    return {
        "lock-step": {"rounds": rounds, "tokens": ls_tokens, "loss": ls_loss},
        "decoupled": {"version": version, "tokens": tokens, "loss": loss},
        "relative_gap": (loss - ls_loss) / ls_loss,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"usage: python {sys.argv[0]} DIR (holding <run>/results.json)", file=sys.stderr)
        return 2
    root = Path(argv[0])
    rows = table(root)
    print(
        "| run | scenario, seed | goodput lock-step / decoupled | loss at equal tokens, lock-step / decoupled "
        "(gap) | final globals' loss (gap), decoupled's tokens / lock-step's | decoupled to lock-step's final "
        "loss | both schedules complete: lock-step's rounds, tokens / decoupled's (gap) | steps merged / executed "
        "| staleness |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        c = row["at_equal_tokens"]
        dec = c["decoupled"]
        loss = (
            f"{c['lock-step']['loss']:.3f} / {dec['loss']:.3f} ({100 * c['relative_gap']:+.1f} %)"
            if dec
            else f"{c['lock-step']['loss']:.3f} / not reached"
        )
        reached = c["to_lock_step_final_loss"]
        to_final = (
            f"{reached['s']:.1f} s vs {reached['lock_step_s']:.1f} s: {reached['ratio']:.2f}x"
            if reached
            else "not reached"
        )
        finals = c["finals"]
        ends = (
            f"{finals['lock-step']['loss']:.3f} / {finals['decoupled']['loss']:.3f} "
            f"({100 * finals['relative_gap']:+.1f} %), "
            f"{finals['decoupled']['tokens'] / finals['lock-step']['tokens']:.2f}"
            if finals
            else "none"
        )
        staleness = ", ".join(f"{age}: {n}" for age, n in row["staleness"].items())
        complete = row["complete_schedules"]
        matched = (
            f"{complete['lock-step']['rounds']}, {complete['lock-step']['tokens'] / 1e6:.3f}M / "
            f"{complete['decoupled']['tokens'] / 1e6:.3f}M ({100 * complete['relative_gap']:+.1f} %)"
            if complete
            else "no shorter lock-step run"
        )
        print(
            f"| {row['run']} | {row['scenario']}, {row['seed']} | {row['lock_step_goodput']:.3f} / "
            f"{row['goodput']:.3f} | {loss} | {ends} | {to_final} | {matched} | {row['merged_steps']} / "
            f"{row['executed_steps']} | {staleness} |"
        )
    (root / "table.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
