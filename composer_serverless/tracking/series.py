"""What the trackers are given: the replicas' rows of a round turned into points, pure functions only.

A tracker step is a global inner step: step ``i`` of round ``k`` is ``(k - 1) * H + i``, whatever the
replica, so a resumed, rolled-back or caught-up run keeps one axis. Per step, each metric is its mean over
the round's replicas that took that step (``train/loss``, ``train/grad_norm``, ``time/sync_s``, the
objective's own ``grpo/...``, ``rollout/...``); per round, at its last step, the held-out evaluation
(``eval/...``) and the exchange (``round/...``: bytes moved, sync time, blocked fraction, quorum size).

A decoupled run's rounds are its global versions, and a learner writes a row per version it adopts, carrying
the contributions it sent since its previous adoption: one, none (two adoptions within one round) or several
(it sent again before it saw the version that merged the first). So the steps of version ``k`` are those of
the contributions its record merged (``merged_step_points``), wherever their rows are: step ``i`` of each at
``(k - 1) * H + i``, lock-step's axis, each merged step once, and ``merged_ready`` waits for those rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Rows = Mapping[int, Sequence[Mapping[str, Any]]]
"""Each replica's metrics rows (``telemetry.read_metrics``)."""

# A step row's keys renamed for the tracker; the objective's own (namespaced: ``grpo/kl``) keep their name.
STEP_KEYS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens": "train/tokens",
    "tokens_per_s": "train/tokens_per_s",
    "generate_tokens_per_s": "rollout/tokens_per_s",
}
COMPLETION_COLUMNS = ("round", "replica", "prompt", "completion", "reward")


def round_rows(rows: Rows, round_index: int) -> list[Mapping[str, Any]]:
    """The rows of round ``round_index`` that report a trained round (not a replica's jump to it)."""
    return [
        row
        for replica_rows in rows.values()
        for row in replica_rows
        if row["round"] == round_index and "caught_up_from" not in row
    ]


def ready(rows: Rows, round_index: int, *, ended: bool) -> bool:
    """Whether round ``round_index`` can be relayed: every replica it averaged wrote its row (each writes it
    right after the sync), the run has ended, or a replica is already two rounds past it (a participant
    that has not written its row by then died before it could). Round 0 is the initial evaluation, over once
    any round was trained."""
    this = round_rows(rows, round_index)
    if round_index == 0:  # evaluated before training starts, if at all
        return bool(this) or ended or any(row["round"] >= 1 for r in rows.values() for row in r)
    if ended or _two_past(rows, round_index):
        return True
    if not this:
        return False
    expected = {p for row in this for p in row.get("participants", ())}
    return expected <= {row["rank"] for row in this}


def step_points(
    rows: Sequence[Mapping[str, Any]], round_index: int, sync_every: int
) -> list[tuple[int, dict[str, float]]]:
    """Per inner step of the round, the mean of each metric over the replicas that took it."""
    return _points([row.get("step_rows", ()) for row in rows], round_index, sync_every)


def every_step(row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every step a row reports: its round's, or a decoupled learner's every contribution's since its
    previous adoption (``earlier_step_rows`` first)."""
    return [step for steps in row.get("earlier_step_rows", ()) for step in steps] + list(
        row.get("step_rows", ())
    )


def contribution_steps(rows: Sequence[Mapping[str, Any]]) -> dict[int, Sequence[Mapping[str, Any]]]:
    """A decoupled learner's step rows per contribution (its sequence number), from its version rows: a row's
    ``step_rows`` are its last contribution's, ``earlier_step_rows`` those of the ones before it."""
    steps: dict[int, Sequence[Mapping[str, Any]]] = {}
    for row in rows:
        sent = row.get("contributions") or []
        if sent:
            earlier = row.get("earlier_step_rows", [[]] * (len(sent) - 1))
            steps.update(zip(sent, [*earlier, row.get("step_rows", [])], strict=True))
    return steps


Carried = Mapping[int, Mapping[int, Sequence[Mapping[str, Any]]]]
"""Per learner, its step rows per contribution its rows carry (``contribution_steps`` of each learner's rows)."""


def merged_step_points(
    carried: Carried, merged: Sequence[Sequence[int]], round_index: int, sync_every: int
) -> list[tuple[int, dict[str, float]]]:
    """Version ``round_index``'s steps: per inner step, the mean of each metric over the contributions it
    merged (``merged``: its record's ``[learner, seq]`` pairs) whose rows were read."""
    found = [carried[learner][seq] for learner, seq in merged if seq in carried.get(learner, {})]
    return _points(found, round_index, sync_every)


def merged_ready(
    rows: Rows, carried: Carried, round_index: int, merged: Sequence[Sequence[int]] | None, *, ended: bool
) -> bool:
    """Whether version ``round_index`` of a decoupled run can be relayed: committed (``merged``, its record's
    pairs; None before), with a learner's row of it and the rows of every contribution it merged, or the run
    has ended, or a learner is already two versions past it (a learner that has not written the row of a
    merged contribution by then died before it adopted again)."""
    if round_index == 0 or ended:
        return ready(rows, round_index, ended=ended)
    if _two_past(rows, round_index):
        return True
    if merged is None or not round_rows(rows, round_index):
        return False
    return all(seq in carried.get(learner, {}) for learner, seq in merged)


def _two_past(rows: Rows, round_index: int) -> bool:
    """Whether a replica already wrote a row two rounds past ``round_index``."""
    return any(row["round"] >= round_index + 2 for replica_rows in rows.values() for row in replica_rows)


def _points(
    step_lists: Sequence[Sequence[Mapping[str, Any]]], round_index: int, sync_every: int
) -> list[tuple[int, dict[str, float]]]:
    """Step ``i`` of round ``round_index`` at ``(round_index - 1) * sync_every + i``: the mean of each metric
    over the lists (a replica's round, a contribution) that have a step ``i``."""
    by_step: dict[int, list[dict[str, float]]] = {}
    for steps in step_lists:
        for i, step in enumerate(steps[:sync_every]):
            by_step.setdefault(i + 1, []).append(flat_step(step))
    base = (round_index - 1) * sync_every
    return [(base + i, mean_of(points)) for i, points in sorted(by_step.items())]


def flat_step(step: Mapping[str, Any]) -> dict[str, float]:
    """A step row's numbers under the tracker's names (the time split as ``time/{phase}_s``)."""
    out: dict[str, float] = {}
    for name, value in step.items():
        if name == "time_s":
            out.update({f"time/{phase}_s": float(v) for phase, v in value.items()})
        elif name == "device_peak_bytes":
            if value is not None:
                out["memory/device_peak_gib"] = value / 2**30
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[STEP_KEYS.get(name, name)] = float(value)
    return out


def round_point(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The round's own figures: its held-out evaluation, the exchange's bytes (summed over replicas), sync
    time, blocked fraction, quorum size and, with the sparse codec, the share of the update its inputs
    carried (means over replicas)."""
    out: dict[str, float] = {}
    for row in rows:
        out.update({name: float(v) for name, v in row.get("eval", {}).items()})
    trained = [row for row in rows if "step_rows" in row]
    if not trained:
        return out
    out["round/bytes_up"] = float(sum(row["bytes_up"] for row in trained))
    out["round/bytes_down"] = float(sum(row["bytes_down"] for row in trained))
    out["round/sync_s"] = _mean([row["time_s"]["sync"] for row in trained])
    out["round/blocked_fraction"] = _mean(
        [row["blocked_s"] / row["round_s"] for row in trained if row["round_s"] > 0]
    )
    out["round/quorum"] = float(max(len(row.get("participants", ())) for row in trained))
    out["round/codec_carried"] = _mean([row["codec_carried"] for row in trained if "codec_carried" in row])
    out["round/seconds"] = _mean([row["round_s"] for row in trained])
    return {name: value for name, value in out.items() if value == value}  # no NaN of an empty mean


def completions(rows: Sequence[Mapping[str, Any]], round_index: int) -> list[list[Any]]:
    """The round's completions table (``COMPLETION_COLUMNS``), replica by replica."""
    return [
        [round_index, row["rank"], c["prompt"], c["completion"], c["reward"]]
        for row in sorted(rows, key=lambda r: r["rank"])
        for c in row.get("completions", ())
    ]


def mean_of(points: Sequence[Mapping[str, float]]) -> dict[str, float]:
    names = sorted({name for point in points for name in point})
    return {name: _mean([p[name] for p in points if name in p]) for name in names}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
