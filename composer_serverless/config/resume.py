"""What ``launch --resume RUN --set key=value`` may change in a run's configuration, and why the rest may not.

A resumed run continues from the states its replicas saved: the global parameters with the outer optimizer,
and each replica's inner optimizer, schedule position, data position and RNG. A key may change only where
those states, and the rounds already run, stay what the new value would have made them: how long the run goes
on, the inner learning rate from here on, and what does not touch the training's arithmetic (evaluation and
checkpoint cadence, timeouts, transfers, trackers, the Hub push, where the replicas run). Every other key is
refused, each with the reason. ``sort_changes`` compares the two configs and reads and writes nothing, so the
launcher refuses before anything is touched.

The user's code is held the same way, by content: the files a resume would ship must be those the run
shipped (the launcher compares their sha256 with the run's record), or ``code.accept_changes`` says to run
them as they are now (``code_refusal_message``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer_serverless.config.run import RunConfig

# Why each key (or table: all the keys in it) may change, or may not. ALLOWED decides over REFUSED (train.lr
# over train); of the executor's keys, those REFUSED does not name may change. A key under none is refused: a
# key added later stays fixed on a resume until someone decides otherwise.
ALLOWED: dict[str, str] = {
    "diloco.rounds": "the run continues to its new end",
    "train.lr": "the restored schedule is placed under the new peak learning rate from the resumed round on",
    "eval.every_rounds": "an evaluation reads the global model and consumes neither data nor randomness",
    "diloco.checkpoint_every": "a checkpoint saves the state, it does not change it",
    "diloco.keep_checkpoints": "a checkpoint saves the state, it does not change it",
    "diloco.verify_global": "a digest is recorded beside the global parameters, not mixed into them",
    **dict.fromkeys(
        (
            "diloco.sync_timeout_s",
            "diloco.store_outage_s",
            "diloco.quorum_grace_min_s",
            "diloco.quorum_grace_max_s",
            "diloco.quorum_grace_mads",
            "diloco.min_replicas",
            "diloco.max_failed_syncs",
            "diloco.transfer_concurrency",
            "diloco.transfer_part_mb",
        ),
        "it says how long replicas wait for each other and the store, and how they move bytes, not what they "
        "compute",
    ),
    "tracking": "the trackers read the metrics, they do not make them",
    "output": "the Hub push happens after the run",
}
_NEW_RUN = (
    "launch a new run from this one's model (`composer-serverless export RUN OUT`, then model.path = OUT)"
)
REFUSED: dict[str, str] = {
    "run_id": "it names the run a resume continues",
    "store": "it names where the run is",
    "executor.type": "the run's earlier attempts were started on this backend; status and cancel reach them "
    "through it",
    "executor.namespace": "the run's earlier jobs run under this namespace; status and cancel reach them "
    "through it",
    "model": "the saved states (the global parameters, the optimizers' moments) are of this model",
    "seed": "the initial weights and the data order follow from it, and each replica's saved position in that "
    "order",
    "data": "the data order follows from it, and each replica's saved position in that order",
    "diloco.replicas": "each replica's share of the data and its saved state belong to its rank; another count "
    "deals the data anew",
    **dict.fromkeys(
        ("diloco.sync_every", "diloco.fragments", "diloco.fragment_sync_delay"),
        "the saved states sit at a round boundary of this schedule, with the model split into these fragments",
    ),
    **dict.fromkeys(
        ("diloco.outer_lr", "diloco.outer_momentum", "diloco.nesterov"),
        "the outer optimizer's saved state carries it: the restored optimizer would keep the old value",
    ),
    **dict.fromkeys(
        (
            "diloco.codec",
            "diloco.sparse_density",
            "diloco.error_feedback",
            "diloco.reduced_codec",
            "diloco.fragment_update_alpha",
            "diloco.outlier_norm_factor",
            "diloco.embedding_average",
        ),
        "it decides what every round averages and applies: the rounds after the resume would not continue the "
        "rounds before",
    ),
    "diloco.authenticate": "the run key and the MAC on every saved state depend on it",
    **dict.fromkeys(
        ("diloco.mode", "diloco.decoupled"),
        "the run's saved states are of this mode (a lock-step round or a decoupled version), and the syncer's "
        "and learners' settings decide what every version merges: the versions after the resume would not "
        "continue the versions before",
    ),
    **dict.fromkeys(
        ("train.optimizer", "train.betas", "train.weight_decay"),
        "the inner optimizer's saved state is of this optimizer and carries its settings: the restored one "
        "would keep the old values",
    ),
    **dict.fromkeys(
        ("train.schedule", "train.warmup_steps", "train.min_lr_ratio"),
        "the saved schedule position is a step of this schedule (train.lr scales it, and may change)",
    ),
    "train": "it changes what every inner step computes (of the inner loop, only train.lr may change)",
    "eval.sequences": "every evaluation scores this many held-out sequences: the curve's points before and "
    "after the resume would not compare",
    **dict.fromkeys(
        ("eval.temperature", "eval.samples", "eval.pass_at", "eval.pass_threshold"),
        "every evaluation decodes and scores the held-out prompts this way: the curve's points before and after "
        "the resume would not compare",
    ),
    "composer": "the composer objective's data, rewards and schedule, and each replica's saved position in its "
    "prompts and pairs, follow from it",
    "harvest": "the live harvest's schedule and the pairs each replica took follow from it",
    "code": "the user's code (rewards, data) the rounds before the resume ran with",
}
_UNLISTED = "it is not among the keys a resume may change"


@dataclass(frozen=True)
class ResumeChanges:
    """The keys a resume changes, as (old, new) by dotted key, and those it may not change, with why."""

    changed: dict[str, tuple[Any, Any]]
    refused: dict[str, str]


def sort_changes(old: RunConfig, new: RunConfig) -> ResumeChanges:
    """Every key whose value differs between the run's config ``old`` and ``new`` (``old`` with the resume's
    overrides), sorted into what a resume may change and what it may not, each refusal with its reason.

    ``diloco.rounds`` may only grow (the run may already have committed every round of its old end), and not
    under a live harvest. The executor may change as long as each replica keeps its number of ranks, whose
    shards the saved states are.
    """
    before, after = _leaves(old.model_dump(mode="json")), _leaves(new.model_dump(mode="json"))
    changed = {
        key: (before.get(key), after.get(key))
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key)
    }
    refused = {key: reason for key in changed if (reason := _refusal(key)) is not None}
    if new.diloco.rounds < old.diloco.rounds:
        refused["diloco.rounds"] = (
            f"a resume only extends a run: it was set to {old.diloco.rounds} rounds and may have committed them "
            "all (to stop earlier, cancel it)"
        )
    elif new.diloco.rounds != old.diloco.rounds and old.live_harvest:
        refused["diloco.rounds"] = (
            "with a live harvest, which round's pairs each round's end takes is laid out over the run's length "
            "(harvest.live_lag): the last rounds already run took none that a longer run's would"
        )
    if old.ranks_per_replica != new.ranks_per_replica:
        for key in changed:
            if key.startswith("executor.") and key not in refused:
                refused[key] = (
                    f"it changes the ranks per replica ({old.ranks_per_replica} -> {new.ranks_per_replica}), "
                    "and each rank saved its own shard of the state"
                )
    return ResumeChanges(changed, dict(sorted(refused.items())))


def refusal_message(refused: dict[str, str]) -> str:
    """The ConfigError text for ``refused``: each key with its reason, then what to do instead."""
    lines = [f"  {key}: {reason}" for key, reason in refused.items()]
    keys = ", ".join(sorted({*ALLOWED, "executor (keeping its ranks per replica)"}))
    return (
        "a resume cannot change these keys of the run's config:\n"
        + "\n".join(lines)
        + f"\n  fix: drop those --set; a resume may change {keys}. To train with other settings, {_NEW_RUN}"
    )


def code_refusal_message(changed: dict[str, tuple[str | None, str | None]]) -> str:
    """The ConfigError text for a resume whose code ``changed`` since the run shipped it (each file as its
    (before, now) sha256, None where absent): each file, then the two ways on."""
    lines = [f"  {rel}: {_digest_change(before, now)}" for rel, (before, now) in changed.items()]
    return (
        "the run's code changed since it was shipped, and a resume runs the code the rounds before it ran with:\n"
        + "\n".join(lines)
        + "\n  fix: undo the changes to resume with that code; or, to run the code as it is now from the resumed "
        "round on (on every backend), resume with --set code.accept_changes=true, which records each changed "
        "file in the run's config-changes.json"
    )


def _digest_change(before: str | None, now: str | None) -> str:
    """A file's change in the message, by the first 12 hex digits of each sha256 (config-changes.json keeps
    them whole)."""
    if before is None:
        return f"added (sha256 {str(now)[:12]})"
    if now is None:
        return f"gone (was sha256 {before[:12]})"
    return f"sha256 {before[:12]} -> {now[:12]}"


def cosine_note(old: RunConfig, new: RunConfig, resumed_round: int) -> str | None:
    """What a new ``diloco.rounds`` does to a cosine learning-rate schedule, which decays over the run's
    length, for the user to read before the rounds run; None where the schedule does not depend on it."""
    if new.diloco.rounds == old.diloco.rounds or new.train.schedule != "cosine":
        return None
    return (
        f"train.schedule is 'cosine': from round {resumed_round + 1} on the learning rate follows the cosine of "
        f"a {new.diloco.rounds}-round run (as an uninterrupted run of that length would from there), not the one "
        f"of {old.diloco.rounds} rounds it followed so far, so the run does not end as an uninterrupted "
        f"{new.diloco.rounds}-round run would (with schedule = 'constant' it does)"
    )


def _refusal(key: str) -> str | None:
    """Why ``key`` may not change on a resume, or None if it may."""
    if any(_under(key, table) for table in ALLOWED):
        return None
    reason = next((why for table, why in REFUSED.items() if _under(key, table)), None)
    if reason is None and not _under(key, "executor"):
        return _UNLISTED
    return reason


def _under(key: str, table: str) -> bool:
    """Whether ``key`` is ``table`` or one of its keys."""
    return key == table or key.startswith(f"{table}.")


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as dotted key -> value; a list is one value (``--set`` cannot address its items)."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(_leaves(value, f"{key}."))
        else:
            out[key] = value
    return out
