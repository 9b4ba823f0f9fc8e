"""The end-of-run report: ``summary.json``, ``loss.png`` and, for runs evaluated by reward, ``reward.png``,
computed from the metrics in the store alone.

Anyone with the run URL can rebuild the report; it needs neither the replicas nor the launcher's memory. Which
headline figures appear depends on what the objective evaluates: a held-out loss (``eval/loss``, the causal-LM
objective) or a held-out reward (``eval/reward``, the composer objective, with ``eval/task/{task}/reward``).
"""

from __future__ import annotations

import io
import json
from typing import Any

from composer_serverless.config import RunConfig
from composer_serverless.data.records import task_label
from composer_serverless.rendezvous import config_changes, layout, recovery
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from composer_serverless.tracking import series

# The per-channel losses of the composer objective, as the replicas report them under "train".
CHANNEL_LOSSES = ("grpo/loss", "sdpo/loss", "replay/loss", "loss/total")
TASK_PREFIX, TASK_SUFFIX = "eval/task/", "/reward"

Curve = list[tuple[int, float]]
Metrics = dict[int, list[dict[str, Any]]]


def eval_curves(metrics: Metrics) -> dict[str, Curve]:
    """Every metric the global model was evaluated on, as (round, value) in round order."""
    curves: dict[str, Curve] = {}
    for rows in metrics.values():
        for row in rows:
            for name, value in row.get("eval", {}).items():
                curves.setdefault(name, []).append((row["round"], value))
    return {name: sorted(points) for name, points in sorted(curves.items())}


def train_curves(metrics: Metrics) -> dict[str, Curve]:
    """Every per-round training metric (the mean over a round's inner steps), averaged over the replicas."""
    values: dict[str, dict[int, list[float]]] = {}
    for rows in metrics.values():
        for row in rows:
            for name, value in row.get("train", {}).items():
                values.setdefault(name, {}).setdefault(row["round"], []).append(value)
    return {
        name: [(k, sum(v) / len(v)) for k, v in sorted(by_round.items())]
        for name, by_round in sorted(values.items())
    }


PHASES = ("generate", "forward_backward", "optimizer", "sync")


def throughput(metrics: Metrics) -> dict[str, Any] | None:
    """The run's speed from its step rows (the numbers the trackers show): tokens trained per second and
    generated per second (per replica: each replica's totals over its steps, averaged over replicas), where
    a step's time went (fractions of all steps' time), and the device's peak memory. None without step rows."""
    per_replica: list[dict[str, float]] = []
    for rows in metrics.values():
        steps = [s for r in rows for s in series.every_step(r)]
        if steps:
            total = {
                "tokens": sum(s["tokens"] or 0.0 for s in steps),
                "generated": sum(s.get("rollout/tokens", 0.0) for s in steps),
                "step_s": sum(s["time_s"]["step"] for s in steps),
                **{phase: sum(s["time_s"][phase] for s in steps) for phase in PHASES},
            }
            per_replica.append(total)
    if not per_replica:
        return None
    step_s = sum(t["step_s"] for t in per_replica)
    peaks = [
        s["device_peak_bytes"]
        for rows in metrics.values()
        for r in rows
        for s in series.every_step(r)
        if s["device_peak_bytes"] is not None
    ]
    trained = [t["tokens"] / t["step_s"] for t in per_replica if t["step_s"] > 0 and t["tokens"]]
    generated = [t["generated"] / t["generate"] for t in per_replica if t["generate"] > 0]
    return {
        "train_tokens_per_s": sum(trained) / len(trained) if trained else None,
        "generate_tokens_per_s": sum(generated) / len(generated) if generated else None,
        "time_split": {
            phase: sum(t[phase] for t in per_replica) / step_s if step_s else None for phase in PHASES
        },
        "device_peak_gib": max(peaks) / 2**30 if peaks else None,
    }


def _task(metric: str) -> str | None:
    """The task of a per-task held-out reward metric (``eval/task/{task}/reward``), else None."""
    if metric.startswith(TASK_PREFIX) and metric.endswith(TASK_SUFFIX):
        return metric[len(TASK_PREFIX) : -len(TASK_SUFFIX)]
    return None


def task_curves(evals: dict[str, Curve]) -> dict[str, Curve]:
    """The held-out reward per task, by task name."""
    return {task: curve for name, curve in evals.items() if (task := _task(name)) is not None}


def _by_round(curve: Curve) -> dict[str, float]:
    return {str(k): v for k, v in curve}


def _initial(curve: Curve) -> float | None:
    return curve[0][1] if curve and curve[0][0] == 0 else None


def _final(curve: Curve) -> float | None:
    return curve[-1][1] if curve else None


def summarise(run: ObjectStore, config: RunConfig, wall_s: float) -> dict[str, Any]:
    """The run's headline numbers. Evaluations are of the global model; bytes are totals over replicas.

    ``bytes_uploaded`` and ``bytes_downloaded`` are the exchange's; ``checkpoint_bytes_uploaded`` is what the
    checkpoints (global and own states, and global states published for a replica that fell behind) wrote.
    ``sync_blocked_fraction`` is the time replicas spent waiting for an exchange in ``work.wait()`` over the
    time their rounds took; rows of rounds a replica skipped by loading a published state carry neither.
    ``rollbacks`` are those the run made by itself when every replica was lost at once (``recovery.py``): the
    round the replicas waited for, the checkpoint they went back to, and the completed rounds they redid
    (``rounds_redone`` in all). ``config_changes`` are the changes resumes made to the run's config (``launch
    --resume --set``): the round each started after, when, and each key from what to what. ``throughput``: the
    tokens per second and the step's time split (``throughput``).
    """
    metrics = read_metrics(run)
    trained = {rank: [r for r in rows if r["round"] > 0] for rank, rows in metrics.items()}
    evals = eval_curves(metrics)
    losses, rewards = evals.get("eval/loss", []), evals.get("eval/reward", [])
    digests: dict[int, set[str]] = {}
    for rows in trained.values():
        for row in rows:
            if "global_sha256" in row:
                digests.setdefault(row["round"], set()).add(row["global_sha256"])
    blocked = sum(r.get("blocked_s", 0.0) for rows in trained.values() for r in rows)
    busy = sum(r.get("round_s", 0.0) for rows in trained.values() for r in rows)
    rolled = recovery.rollbacks(run)
    return {
        "run_id": config.run_id,
        "run_url": run.url,
        "objective": config.train.objective,
        "mode": config.diloco.mode,  # in decoupled mode a "round" is a global version, a replica a learner
        "replicas": config.diloco.replicas,
        "sync_every": config.diloco.sync_every,
        "fragments": config.diloco.fragments,
        "rounds": config.diloco.rounds,
        "rounds_committed": max((r["round"] for rows in trained.values() for r in rows), default=0),
        "initial_eval_loss": _initial(losses),
        "final_eval_loss": _final(losses),
        "eval_loss_by_round": _by_round(losses),
        "initial_eval_reward": _initial(rewards),
        "final_eval_reward": _final(rewards),
        "eval_reward_by_round": _by_round(rewards),
        "eval_reward_by_task": {
            task: {"initial": _initial(c), "final": _final(c), "best": max(v for _, v in c)}
            for task, c in task_curves(evals).items()
        },
        "eval_by_round": {name: _by_round(curve) for name, curve in evals.items()},
        "train_by_round": {name: _by_round(curve) for name, curve in train_curves(metrics).items()},
        "replicas_bit_identical": bool(digests) and all(len(d) == 1 for d in digests.values()),
        "bytes_uploaded": sum(r.get("bytes_up", 0) for rows in trained.values() for r in rows),
        "bytes_downloaded": sum(r.get("bytes_down", 0) for rows in trained.values() for r in rows),
        "checkpoint_bytes_uploaded": sum(
            r.get("checkpoint_bytes_up", 0) for rows in trained.values() for r in rows
        ),
        "sync_blocked_fraction": blocked / busy if busy else None,
        "throughput": throughput(trained),
        "rollbacks": [{"waited_for": r.waited_for, "to": r.to, "redone": r.redone} for r in rolled],
        "rounds_redone": sum(r.redone for r in rolled),
        "config_changes": config_changes.read(run),
        "wall_s": round(wall_s, 2),
    }


def write_report(run: ObjectStore, config: RunConfig, wall_s: float) -> dict[str, Any]:
    summary = summarise(run, config, wall_s)
    metrics = read_metrics(run)
    run.put(layout.SUMMARY, json.dumps(summary, indent=2).encode())
    run.put(layout.LOSS_PLOT, plot_losses(metrics))
    if "eval/reward" in eval_curves(metrics):
        run.put(layout.REWARD_PLOT, plot_rewards(metrics))
    return summary


def speed(summary: dict[str, Any]) -> str | None:
    """One line for the end of a run: its tokens per second, where a step's time went, its peak memory."""
    figures = summary.get("throughput")
    if figures is None:
        return None
    parts = []
    if figures["train_tokens_per_s"] is not None:
        parts.append(f"{figures['train_tokens_per_s']:,.0f} trained tokens/s per replica")
    if figures["generate_tokens_per_s"] is not None:
        parts.append(f"{figures['generate_tokens_per_s']:,.0f} generated tokens/s")
    split = [(phase, share) for phase, share in figures["time_split"].items() if share]
    if split:
        parts.append(
            "a step's time: "
            + ", ".join(
                f"{phase.replace('_', '-')} {share:.0%}"
                for phase, share in sorted(split, key=lambda x: -x[1])
            )
        )
    if figures["device_peak_gib"] is not None:
        parts.append(f"peak device memory {figures['device_peak_gib']:.1f} GiB")
    return "speed: " + "; ".join(parts) if parts else None


def outcome(summary: dict[str, Any]) -> list[str]:
    """What the run achieved, one line per figure it was evaluated on: its held-out loss (the causal-LM
    objective) or reward (the composer objective) from the initial to the final global model."""
    lines = []
    for what, key in (("loss", "eval_loss"), ("reward", "eval_reward")):
        final, initial = summary.get(f"final_{key}"), summary.get(f"initial_{key}")
        if final is not None:
            start = "-" if initial is None else f"{initial:.4f}"
            lines.append(f"held-out {what} of the global model: {start} -> {final:.4f}")
    return lines


def progress_figure(config: RunConfig) -> str:
    """The heartbeat figure a replica's progress is shown by: a composer run's rollout reward (its loss mixes
    three channels and says little), else the training loss."""
    return "reward" if config.train.objective == "composer" else "loss"


def eval_headline(evaluation: dict[str, float]) -> str:
    """One line for a progress log: the held-out loss or reward of the global model, per task if there are
    several (one would repeat the whole's figure)."""
    if "eval/reward" in evaluation:
        tasks = [(task, v) for name, v in sorted(evaluation.items()) if (task := _task(name)) is not None]
        detail = (
            f" ({', '.join(f'{task_label(task)} {v:.2f}' for task, v in tasks)})" if len(tasks) > 1 else ""
        )
        return f"held-out reward of the global model {evaluation['eval/reward']:.3f}{detail}"
    if "eval/loss" in evaluation:
        return f"held-out loss of the global model {evaluation['eval/loss']:.4f}"
    return ", ".join(f"{name} {value:.4f}" for name, value in sorted(evaluation.items()))


def _figure(panels: int) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, panels, figsize=(7 * panels, 4.2), dpi=120, squeeze=False)


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()


def plot_losses(metrics: Metrics) -> bytes:
    """PNG: each replica's mean training loss per round, and the global model's eval loss if it has one."""
    fig, axes = _figure(1)
    ax = axes[0][0]
    for rank, rows in sorted(metrics.items()):
        points = [(r["round"], r["train_loss"]) for r in rows if r.get("train_loss") is not None]
        if points:
            ax.plot(*zip(*points, strict=True), lw=1, alpha=0.7, label=f"replica {rank} train")
    losses = eval_curves(metrics).get("eval/loss")
    if losses:
        ax.plot(*zip(*losses, strict=True), "k-o", lw=2, ms=4, label="global model, held-out")
    ax.set_xlabel("outer round")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def plot_rewards(metrics: Metrics) -> bytes:
    """PNG: left, the global model's held-out reward per round (overall and per task) and the replicas' mean
    rollout reward; right, each loss channel per round (mean over the round's steps and the replicas)."""
    fig, axes = _figure(2)
    rewards, losses = axes[0]
    evals, train = eval_curves(metrics), train_curves(metrics)
    rewards.plot(*zip(*evals["eval/reward"], strict=True), "k-o", lw=2, ms=4, label="held-out, all tasks")
    tasks = task_curves(evals)
    if len(tasks) > 1:  # one task's curve would be the whole's again
        for task, curve in tasks.items():
            rewards.plot(*zip(*curve, strict=True), lw=1.2, marker=".", label=f"held-out, {task_label(task)}")
    if "rollout/reward_mean" in train:
        rewards.plot(
            *zip(*train["rollout/reward_mean"], strict=True), "k--", lw=1, label="rollouts (sampled)"
        )
    rewards.set_title("reward of the global model (greedy), per round")
    rewards.set_xlabel("outer round")
    rewards.set_ylabel("reward")
    rewards.grid(alpha=0.3)
    rewards.legend(fontsize=7, ncol=2)
    for name in CHANNEL_LOSSES:
        if name in train:
            total = name == "loss/total"
            label = "loss/total = grpo + alpha * sdpo + beta * replay" if total else f"{name} (unweighted)"
            losses.plot(*zip(*train[name], strict=True), "k-" if total else "-", marker=".", label=label)
    losses.axhline(0, color="grey", lw=0.5)
    losses.set_title("loss channels (mean over inner steps and replicas)")
    losses.set_xlabel("outer round")
    losses.set_ylabel("loss")
    losses.grid(alpha=0.3)
    losses.legend(fontsize=8)
    return _png(fig)
