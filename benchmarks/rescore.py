"""Score the globals of ``benchmarks/goodput.py`` runs again on more held-out sequences.

    python benchmarks/rescore.py OUT [OUT ...] --sequences 256 --from-version 80 --json rescored.json

``goodput.py`` scores every global on ``--eval-sequences`` held-out sequences (16 by default) because
lock-step's replicas score each round inside the run, on the run's clock. Its curves move by 1-2 % from one
version to the next on those 16 alone, as much as the issue's bars, so "decoupled reaches lock-step's final
loss" is decided there by which evaluations happen to be low. This scores lock-step's final global (the run's
``final/``) and decoupled's versions from ``--from-version`` on (the store keeps every version) on
``--sequences`` held-out sequences, with the product's evaluation as ``goodput.scorer`` (the same
objective, held-out stream and compute precision, only more of it), and puts them through
``goodput.at_equal_tokens`` with the times and tokens the run recorded: decoupled's first version scoring at
most lock-step's final, and its seconds against lock-step's.

Each ``OUT`` is one ``goodput.py --out`` of one scenario with both modes, or with decoupled only (``--modes
decoupled``, one configuration against a lock-step run made once per seed, as ``goodput_table.py`` compares
them): its lock-step run is then the one of the same scenario and seed among the ``--lock-step`` directories.
Writes the JSON and prints a line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from goodput import at_equal_tokens, scorer  # noqa: E402

from composer_serverless.config import RunConfig  # noqa: E402
from composer_serverless.rendezvous import decoupled as store_versions  # noqa: E402
from composer_serverless.rendezvous import layout  # noqa: E402
from composer_serverless.rendezvous.store import ObjectStore  # noqa: E402


def _scorer(
    run: ObjectStore, sequences: int, cache: Path
) -> tuple[Callable[[dict[str, torch.Tensor]], float], set[str]]:
    """``goodput.scorer`` for the run's config with ``sequences`` held-out sequences."""
    config = RunConfig.model_validate_json(run.get(layout.RUN_CONFIG))
    raw = config.model_dump()
    raw["eval"]["sequences"] = sequences
    return scorer(run, RunConfig.model_validate(raw), cache)


def _one_scenario(out: Path) -> tuple[str, int | None, dict[str, Any]]:
    """The scenario, seed and per-mode results of one goodput ``--out``."""
    data = json.loads((out / "results.json").read_text())
    (scenario, modes), *rest = data["results"].items()
    if rest:
        raise SystemExit(f"{out}: expected one scenario, found {sorted(data['results'])}")
    return scenario, data.get("seed"), modes


def rescore(
    out: Path, sequences: int, from_version: int, lock_step_out: Path | None = None
) -> dict[str, Any]:
    """Lock-step's final and decoupled's versions from ``from_version`` of one goodput ``--out``; lock-step's
    from ``lock_step_out`` when given (``out`` then holds decoupled's run only)."""
    scenario, _, both = _one_scenario(out)
    lock_step_out = lock_step_out or out
    lock_step = _one_scenario(lock_step_out)[2].get("lock-step")
    decoupled = both.get("decoupled")
    if not lock_step or not decoupled:
        raise SystemExit(f"{out}: expected a lock-step and a decoupled run, found {sorted(both)}")
    with tempfile.TemporaryDirectory(prefix="rescore-") as cache:
        lock_step_dir = lock_step_out / "runs" / lock_step["run_id"]
        run = ObjectStore(f"file://{lock_step_dir}")
        score, names = _scorer(run, sequences, Path(cache) / "lock-step")
        final = safetensors.torch.load_file(str(lock_step_dir / layout.FINAL / "model.safetensors"))
        missing = names - set(final)
        if missing:
            raise SystemExit(f"{out}: lock-step's final/ lacks {sorted(missing)[:3]}")
        last = lock_step["evals"][-1]
        lock_step_final = [*last[:3], score({n: final[n] for n in names})]

        run = ObjectStore(f"file://{out / 'runs' / decoupled['run_id']}")
        score, _ = _scorer(run, sequences, Path(cache) / "decoupled")
        versions = []
        for v, tokens, seconds, _ in decoupled["evals"]:
            if v >= from_version:
                record = store_versions.read_version(run, int(v))
                versions.append([v, tokens, seconds, score(store_versions.load_params(run, record, None))])
                print(f"  {decoupled['run_id']} version {v}: {versions[-1][3]:.4f}", flush=True)
    return {
        "out": str(out),
        **({} if lock_step_out == out else {"lock_step_out": str(lock_step_out)}),
        "scenario": scenario,
        "sequences": sequences,
        "lock_step": {"run_id": lock_step["run_id"], "final": lock_step_final, "wall_s": lock_step["wall_s"]},
        "decoupled": {"run_id": decoupled["run_id"], "evals": versions, "wall_s": decoupled["wall_s"]},
        "compared": at_equal_tokens([lock_step_final], versions),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "outs", nargs="+", type=Path, help="goodput.py --out directories, both modes or decoupled only each"
    )
    parser.add_argument(
        "--lock-step",
        action="append",
        default=[],
        type=Path,
        metavar="OUT",
        help="a goodput.py --out holding a lock-step run (repeatable): an OUT without one is compared with "
        "the one of its scenario and seed",
    )
    parser.add_argument("--sequences", type=int, default=256, help="held-out sequences per evaluation")
    parser.add_argument("--from-version", type=int, default=1, help="decoupled's first version to score")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    args = parser.parse_args(argv)
    if args.sequences < 1 or args.from_version < 1:
        parser.error("--sequences and --from-version must be >= 1")
    for out in args.outs + args.lock_step:
        if not (out / "results.json").is_file() or not (out / "runs").is_dir():
            parser.error(f"{out} is not a goodput.py --out with its runs: no results.json or runs/ there")
    lock_steps: dict[tuple[str, int | None], list[Path]] = {}
    for candidate in args.lock_step:
        scenario, seed, modes = _one_scenario(candidate)
        if "lock-step" in modes:
            lock_steps.setdefault((scenario, seed), []).append(candidate)
    pairs = [(out, _lock_step_out(out, lock_steps, parser)) for out in args.outs]
    rows = []
    for out, lock_step_out in pairs:
        row = rescore(out, args.sequences, args.from_version, lock_step_out)
        rows.append(row)
        reached = row["compared"]["to_lock_step_final_loss"]
        print(
            f"{out}: lock-step final {row['lock_step']['final'][3]:.4f}, decoupled final "
            f"{row['decoupled']['evals'][-1][3]:.4f} ({row['compared']['finals']['relative_gap']:+.2%}), "
            + (
                f"reached at version {reached['version']}: {reached['ratio']:.2f}x"
                if reached
                else "lock-step's final not reached"
            ),
            flush=True,
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows}, indent=1) + "\n")
    return 0


def _lock_step_out(
    out: Path, lock_steps: dict[tuple[str, int | None], list[Path]], parser: argparse.ArgumentParser
) -> Path | None:
    """Where ``out``'s lock-step run is: ``out`` itself (None) when it holds one, else the one ``--lock-step``
    directory of its scenario and seed (``lock_steps``); decided for every ``OUT`` before anything is
    scored."""
    scenario, seed, modes = _one_scenario(out)
    if "decoupled" not in modes:
        parser.error(f"{out} holds no decoupled run to score (it holds {', '.join(sorted(modes))})")
    if "lock-step" in modes:
        return None
    found = lock_steps.get((scenario, seed), [])
    if len(found) != 1:
        parser.error(
            f"{out} holds no lock-step run and {len(found)} --lock-step directories hold one of its "
            f"scenario ({scenario}) and seed ({seed}): give exactly one"
        )
    return found[0]


if __name__ == "__main__":
    raise SystemExit(main())
