"""The end-of-run report: ``summary.json`` and ``loss.png``, computed from the metrics in the store alone.

Anyone with the run URL can rebuild the report; it needs neither the replicas nor the launcher's memory.
"""

from __future__ import annotations

import io
import json
from typing import Any

from composer_serverless.config import RunConfig
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.telemetry import read_metrics

SUMMARY_KEY = "summary.json"
PLOT_KEY = "loss.png"


def summarise(run: ObjectStore, config: RunConfig, wall_s: float) -> dict[str, Any]:
    """The run's headline numbers. Eval losses are of the global model; bytes are totals over replicas."""
    metrics = read_metrics(run)
    trained = {rank: [r for r in rows if r["round"] > 0] for rank, rows in metrics.items()}
    evals = _eval_curve(metrics)
    digests: dict[int, set[str]] = {}
    for rows in trained.values():
        for row in rows:
            if "global_sha256" in row:
                digests.setdefault(row["round"], set()).add(row["global_sha256"])
    blocked = sum(r["blocked_s"] for rows in trained.values() for r in rows)
    busy = sum(r["round_s"] for rows in trained.values() for r in rows)
    return {
        "run_id": config.run_id,
        "run_url": run.url,
        "replicas": config.diloco.replicas,
        "sync_every": config.diloco.sync_every,
        "fragments": config.diloco.fragments,
        "rounds": config.diloco.rounds,
        "rounds_committed": min((len(rows) for rows in trained.values()), default=0),
        "initial_eval_loss": evals[0][1] if evals and evals[0][0] == 0 else None,
        "final_eval_loss": evals[-1][1] if evals else None,
        "eval_loss_by_round": {str(k): v for k, v in evals},
        "replicas_bit_identical": bool(digests) and all(len(d) == 1 for d in digests.values()),
        "bytes_uploaded": sum(rows[-1]["bytes_up"] for rows in trained.values() if rows),
        "bytes_downloaded": sum(rows[-1]["bytes_down"] for rows in trained.values() if rows),
        "sync_blocked_fraction": blocked / busy if busy else None,
        "wall_s": round(wall_s, 2),
    }


def write_report(run: ObjectStore, config: RunConfig, wall_s: float) -> dict[str, Any]:
    summary = summarise(run, config, wall_s)
    run.put(SUMMARY_KEY, json.dumps(summary, indent=2).encode())
    run.put(PLOT_KEY, plot_losses(read_metrics(run)))
    return summary


def plot_losses(metrics: dict[int, list[dict[str, Any]]]) -> bytes:
    """PNG: the global model's eval loss per round, and each replica's mean training loss per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for rank, rows in sorted(metrics.items()):
        points = [(r["round"], r["train_loss"]) for r in rows if "train_loss" in r]
        if points:
            ax.plot(*zip(*points, strict=True), lw=1, alpha=0.7, label=f"replica {rank} train")
    evals = _eval_curve(metrics)
    if evals:
        ax.plot(*zip(*evals, strict=True), "k-o", lw=2, ms=4, label="global model, held-out")
    ax.set_xlabel("outer round")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()


def _eval_curve(metrics: dict[int, list[dict[str, Any]]]) -> list[tuple[int, float]]:
    rows = [r for rank_rows in metrics.values() for r in rank_rows if "eval" in r]
    return sorted((r["round"], r["eval"]["eval/loss"]) for r in rows)
