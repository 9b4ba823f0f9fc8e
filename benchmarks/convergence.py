"""DiLoCo against its baselines at equal inner steps: data-parallel (same tokens) and a single worker.

    python benchmarks/diloco_vs_dp.py --config deploy/configs/local-demo.toml --out bench-out/diloco_vs_dp

Every run starts from the same tiny model (the launcher builds it deterministically from the seed) and is
scored on the same held-out sequences after every sync_every steps:

- ``dp``: one model, batch = replicas x batch_size (the same tokens DiLoCo sees), the same LR schedule;
- ``single``: one model, batch = batch_size (a quarter of the tokens for 4 replicas);
- ``diloco[...]``: real launches (subprocess replicas, store exchange) with the config's outer optimizer, the
  DiLoCo paper's (lr 0.7, momentum 0.9, Nesterov) and FedAvg-style averaging (lr 1, no momentum).

Writes ``results.json`` (final loss, loss per round, wall time per variant) and ``curves.png``.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import torch
from rich.console import Console

from composer_serverless.config import RunConfig, load_config
from composer_serverless.launcher import launch
from composer_serverless.models import load_pretrained
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.objective import LMObjective
from composer_serverless.replicas.trainer import make_inner_optimizer, make_schedule

OUTER = {
    "paper": {"diloco.outer_lr": 0.7, "diloco.outer_momentum": 0.9, "diloco.nesterov": True},
    "fedavg": {"diloco.outer_lr": 1.0, "diloco.outer_momentum": 0.0, "diloco.nesterov": False},
}


def baseline(config: RunConfig, model_dir: Path, batch_size: int) -> dict:
    """Plain training of one model with the config's inner optimizer and schedule, scored every sync_every steps."""
    solo = config.model_copy(
        update={
            "data": config.data.model_copy(update={"batch_size": batch_size}),
            "diloco": config.diloco.model_copy(update={"replicas": 1}),
        }
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.seed)
    model, tokenizer = load_pretrained(model_dir, config.model.dtype)
    model.to(device).train()
    objective = LMObjective(solo, tokenizer, rank=0)
    steps = config.diloco.rounds * config.diloco.sync_every
    inner = make_inner_optimizer(model, config.train)
    schedule = make_schedule(inner, config.train, steps)
    curve = {0: objective.evaluate(model)["eval/loss"]}
    started = time.monotonic()
    for step in range(1, steps + 1):
        loss, _ = objective.loss(model)
        loss.backward()
        if config.train.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
        inner.step()
        schedule.step()
        inner.zero_grad(set_to_none=True)
        if step % config.diloco.sync_every == 0:
            curve[step // config.diloco.sync_every] = objective.evaluate(model)["eval/loss"]
    return {"final_eval_loss": curve[max(curve)], "curve": curve, "wall_s": time.monotonic() - started}


def diloco(config_path: str, store: Path, name: str, overrides: dict) -> tuple[dict, Path]:
    config = load_config(config_path, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    config = config.model_copy(update={"store": str(store), "run_id": name})  # validated again by the launcher
    summary = launch(config, config_path, Console(file=io.StringIO()))
    curve = {int(k): v for k, v in summary["eval_loss_by_round"].items()}
    run = ObjectStore(str(store)).child(name)
    return {"final_eval_loss": summary["final_eval_loss"], "curve": curve, "wall_s": summary["wall_s"]}, run


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, row in results["variants"].items():
        rounds = sorted(row["curve"], key=int)
        ax.plot([int(r) for r in rounds], [row["curve"][r] for r in rounds], label=f"{name}: {row['final_eval_loss']:.3f}")
    ax.set_xlabel(f"round (x {results['sync_every']} inner steps)")
    ax.set_ylabel("held-out cross-entropy")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/configs/local-demo.toml")
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json and curves.png")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "runs"
    config = load_config(args.config)
    dl = config.diloco
    own = {"diloco.outer_lr": dl.outer_lr, "diloco.outer_momentum": dl.outer_momentum, "diloco.nesterov": dl.nesterov}
    variants: dict[str, dict] = {}
    runs = {"diloco-config": own, **{f"diloco-{k}": v for k, v in OUTER.items()}}
    model_dir = None
    for name, overrides in runs.items():
        variants[name], run = diloco(args.config, store, name, overrides)
        model_dir = model_dir or run.local_dir("model")
        print(name, round(variants[name]["final_eval_loss"], 4), flush=True)
    variants["dp"] = baseline(config, model_dir, dl.replicas * config.data.batch_size)
    variants["single"] = baseline(config, model_dir, config.data.batch_size)
    results = {
        "config": args.config,
        "replicas": dl.replicas,
        "sync_every": dl.sync_every,
        "rounds": dl.rounds,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "config_outer": own,
        "variants": variants,
        "gap_to_dp": {k: v["final_eval_loss"] / variants["dp"]["final_eval_loss"] - 1 for k, v in variants.items()},
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "curves.png")
    print(json.dumps({k: round(v["final_eval_loss"], 4) for k, v in variants.items()}, indent=2))


if __name__ == "__main__":
    main()
