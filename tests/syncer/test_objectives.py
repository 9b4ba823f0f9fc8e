"""Decoupled mode with the composer objective and with LoRA, as real learner and syncer processes on the
simulated accelerator.

The oracle of each: a quorum of every learner, ``max_lag = 0``, no grace bound, and the run ends on lock-step
DiLoCo's final global bit for bit, every learner's per-round training figures (the rollouts' rewards, the
three channels' losses) are lock-step's, and the final version's held-out evaluation is lock-step's final
one. With ``max_lag = 1`` (through the launcher) each ends with its final evaluation row and an export."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import RunConfig, validate_config
from composer_serverless.launch.launcher import launch
from composer_serverless.models.loading import load_model
from composer_serverless.outputs.export import export
from composer_serverless.rendezvous import checkpoint, layout
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous.codec import read_header
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.run_keys import key_path
from composer_serverless.rendezvous.runkey import ENV, MAC_FIELD, RunKey
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats
from tests.composer_tasks import TINY_CHARS, composer
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator
from tests.lora_export import assert_merged_export
from tests.rendezvous.harness import create, rows, run_replicas, start_replica, wait_all
from tests.syncer.processes import run_decoupled
from tests.syncer.test_oracle import lockstep_final

pytestmark = pytest.mark.slow

LEARNERS = 2
ROUNDS = 2
DILOCO = {
    "replicas": LEARNERS,
    "sync_every": 2,
    "rounds": ROUNDS,
    "min_replicas": LEARNERS,
    "embedding_average": "all",
    "sync_timeout_s": 120,
}
COMPOSER = composer(group_size=4, prompts_per_step=2, max_new_tokens=4, pairs_per_step=2)


def composer_config(store: Path, run_id: str, top: dict[str, Any] | None = None, **diloco: Any) -> RunConfig:
    """The composer run of the suite's tiny task; ``top`` replaces whole tables of it."""
    return validate_config(
        {
            "run_id": run_id,
            "store": str(store),
            "seed": 0,
            "model": {"tiny": TINY_CHARS},
            "train": {"objective": "composer", "lr": 1e-3},
            "diloco": {**DILOCO, **diloco},
            "eval": {"sequences": 4},
            "composer": COMPOSER,
            "executor": {"threads_per_replica": 1},
        }
        | (top or {})
    )


def lora_config(store: Path, run_id: str, model_dir: Path, **diloco: Any) -> RunConfig:
    return validate_config(
        {
            "run_id": run_id,
            "store": str(store),
            "seed": 0,
            "model": {"path": str(model_dir), "lora": {"r": 4}},
            "data": {"seq_len": 16, "batch_size": 2},
            "train": {"lr": 1e-2},
            "diloco": {**DILOCO, **diloco},
            "eval": {"sequences": 2},
            "executor": {"threads_per_replica": 1},
        }
    )


def untimed(figures: dict[str, float]) -> dict[str, float]:
    """A row's figures without those measured in seconds."""
    return {name: value for name, value in figures.items() if not name.endswith("_s")}


def run_both(tmp_path: Path, make) -> tuple[ObjectStore, ObjectStore]:
    """The lock-step run and the decoupled one (``max_lag = 0``, a quorum of all) of the same config."""
    with replicas_on_the_simulated_accelerator():
        lockstep = create(make("lockstep"))
        assert run_replicas(lockstep, tmp_path / "lockstep-logs", LEARNERS) == [0] * LEARNERS
        decoupled = create(make("decoupled", mode="decoupled"))
        assert run_decoupled(decoupled, tmp_path / "decoupled-logs", LEARNERS) == [0] * (LEARNERS + 1)
    assert ran_on_the_simulated_accelerator(tmp_path / "lockstep-logs")
    assert ran_on_the_simulated_accelerator(tmp_path / "decoupled-logs")
    return lockstep, decoupled


def assert_oracle(lockstep: ObjectStore, decoupled: ObjectStore) -> dict[str, torch.Tensor]:
    """The two runs started from the same weights and end on the same global, bit for bit; the global."""
    assert lockstep.get(layout.INITIAL_WEIGHTS) == decoupled.get(layout.INITIAL_WEIGHTS)
    final = versions.read_version(decoupled, ROUNDS)
    assert sorted(map(tuple, final.merged)) == [(learner, ROUNDS - 1) for learner in range(LEARNERS)]
    assert final.dropped == []
    merged = versions.load_params(decoupled, final, None)
    expected = lockstep_final(lockstep, ROUNDS)
    assert set(merged) == set(expected)
    unequal = [name for name in expected if not torch.equal(merged[name], expected[name])]
    assert unequal == [], f"differ from lock-step: {unequal}"
    # The last merge moved the global (the versions before the newest two are pruned: keep_versions 2).
    before = versions.load_params(decoupled, versions.read_version(decoupled, ROUNDS - 1), None)
    assert any(not torch.equal(before[name], merged[name]) for name in merged)
    beats = read_heartbeats(decoupled)
    assert [beats[rank]["state"] for rank in range(LEARNERS)] == ["done"] * LEARNERS
    return merged


def test_the_composer_objective_decoupled_with_a_full_quorum_is_lockstep_bit_for_bit(tmp_path: Path) -> None:
    # Lock-step averages its replicas' pseudo-gradients equally; decoupled mode's default weighs them by
    # tokens, which here (the completions' lengths) differ from learner to learner.
    lockstep, decoupled = run_both(
        tmp_path,
        lambda run_id, **d: composer_config(tmp_path / "runs", run_id, decoupled={"weighting": "equal"}, **d),
    )
    assert_oracle(lockstep, decoupled)
    ours, theirs = rows(decoupled), rows(lockstep)
    for rank in range(LEARNERS):
        for version in range(1, ROUNDS + 1):
            # The same rollouts (sampled from the global each adopted: no engine keeps stale weights), the
            # same rewards and losses, per version as per round (timings aside).
            train = untimed(ours[rank][version]["train"])
            assert train == untimed(theirs[rank][version]["train"]), (rank, version)
            assert train["rollout/tokens"] > 0 and train["replay/pairs"] == 2
            assert len(ours[rank][version]["completions"]) == len(theirs[rank][version]["completions"]) > 0
    # The final version's held-out decodes, scored whole by learner 0, are lock-step's (scored in shares).
    scored = ours[0][ROUNDS]["eval"]
    assert set(scored) == set(theirs[0][ROUNDS]["eval"]) and "eval/task/digit/reward" in scored
    assert scored == pytest.approx(theirs[0][ROUNDS]["eval"], rel=1e-6)


def test_lora_decoupled_with_a_full_quorum_is_lockstep_bit_for_bit(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    lockstep, decoupled = run_both(
        tmp_path, lambda run_id, **d: lora_config(tmp_path / "runs", run_id, tiny_model_dir, **d)
    )
    merged = assert_oracle(lockstep, decoupled)
    # Only the adapters are versioned and merged: contributions carry their values and nothing else.
    assert merged and all("lora_" in name for name in merged)
    values = sum(t.numel() for t in merged.values())
    # (the last contributions are kept: version ROUNDS - 1, kept, had not consumed them)
    header = read_header(decoupled.get(layout.contribution(0, ROUNDS - 1)))[0]["__metadata__"]
    assert int(header["numel"]) == values
    ours, theirs = rows(decoupled), rows(lockstep)
    assert ours[0][ROUNDS]["eval"] == pytest.approx(theirs[0][ROUNDS]["eval"], rel=1e-6)


def launched(config: RunConfig) -> tuple[ObjectStore, dict[str, Any]]:
    """The run through the real launcher (its local executor starts the learners and the syncer)."""
    with replicas_on_the_simulated_accelerator():
        summary = launch(config, str(config.run_id), Console(file=io.StringIO()))
    run = ObjectStore(config.store).child(str(config.run_id))
    assert ran_on_the_simulated_accelerator(run.local_dir("logs"))
    return run, summary


def test_the_composer_objective_one_version_ahead_ends_with_its_eval_rollouts_and_export(
    tmp_path: Path,
) -> None:
    top = {
        "composer": {**COMPOSER, "record_rollouts": True},
        "tracking": {"report_to": ["tensorboard"], "dir": str(tmp_path / "tb")},
    }
    run, summary = launched(
        composer_config(tmp_path, "lagged", top, mode="decoupled", decoupled={"max_lag": 1})
    )
    assert summary["rounds_committed"] == ROUNDS and summary["final_eval_reward"] is not None
    assert set(summary["eval_reward_by_task"]) == {"digit", "first", "last", "max"}
    by_rank = rows(run)
    # The initial model's evaluation, scored by learner 0 as version 0's (round 0's row, as lock-step's).
    assert summary["initial_eval_reward"] is not None and set(by_rank[0].pop(0)) == {
        "rank",
        "round",
        "eval",
        "time",
    }
    per_step = COMPOSER["rollout"]["prompts_per_step"] * COMPOSER["rollout"]["group_size"]
    for rank in range(LEARNERS):
        assert max(by_rank[rank]) == ROUNDS
        for version, row in by_rank[rank].items():
            # A row per version adopted (on arrival, between inner steps: adopt_when's default), with the
            # rollout figures of the contributions sent since the last one, and the rollouts of the steps
            # trained since the last one recorded under the version: at most the rounds of those
            # contributions and the steps of the round in progress (a completion drawn twice for one prompt
            # is recorded once).
            assert row["version"] == version and row["completions"]
            if row["contributions"]:
                assert row["train"]["rollout/tokens"] > 0
            recorded = [json.loads(line) for line in run.get(layout.rollouts(version, rank)).splitlines()]
            steps = DILOCO["sync_every"] * len(row["contributions"]) + row["adopted_at_step"]
            assert 0 < len(recorded) <= per_step * steps
            assert all(r["id"].startswith(f"r{rank}-k{version}-") and "reward" in r for r in recorded)
    evaluated = [rank for rank in range(LEARNERS) if "eval" in by_rank[rank][ROUNDS]]
    assert len(evaluated) == 1 and "eval/reward" in by_rank[evaluated[0]][ROUNDS]["eval"]
    events = EventAccumulator(str(run.local_dir(layout.TRACKING_TENSORBOARD)), size_guidance={"scalars": 0})
    events.Reload()
    steps = ROUNDS * DILOCO["sync_every"]
    assert [e.step for e in events.Scalars("rollout/reward_mean")] == list(range(1, steps + 1))
    assert [e.step for e in events.Scalars("eval/reward")] == [0, steps]
    # The export is the final version's global.
    export(run.url, tmp_path / "out")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    final = versions.load_params(run, versions.read_version(run, ROUNDS), None)
    assert all(torch.equal(exported[name], final[name]) for name in final if name in exported)
    assert set(final) - set(exported) <= {"lm_head.weight"}  # tied to the embeddings


@pytest.mark.parametrize("sharded", [False, True], ids=["one-syncer", "two-keyed-shards"])
def test_lora_one_version_ahead_ends_with_its_eval_and_merged_export(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool
) -> None:
    """Sharded: a syncer of two shards, the run authenticated (its key kept where the launcher keeps it): the
    launcher starts both shards with the learners, the adapters are cut into two fragments, every object of a
    contribution and every snapshot of a version carries a MAC, and the export reads the run with its key."""
    keyed = {"authenticate": True} if sharded else {}
    if sharded:
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
        monkeypatch.delenv(ENV, raising=False)
    decoupled = {"max_lag": 1, "syncer_shards": 2 if sharded else 1}
    run, summary = launched(
        lora_config(tmp_path, "lagged", tiny_model_dir, mode="decoupled", decoupled=decoupled, **keyed)
    )
    assert summary["rounds_committed"] == ROUNDS and summary["final_eval_loss"] is not None
    record = versions.read_version(run, ROUNDS)
    assert len(record.fragments) == len(record.parts) == (2 if sharded else 0)
    if sharded:
        for writer in record.parts:
            name = layout.snapshot_file(layout.global_params(ROUNDS, writer), layout.SNAPSHOT_MANIFEST)
            assert all(MAC_FIELD in entry for entry in json.loads(run.get(name))["files"].values())
        fragments = [n for n in run.list(layout.contributions(0)) if "-" in n]
        assert fragments and all(
            MAC_FIELD in read_header(run.get(f"{layout.contributions(0)}/{n}"))[0]["__metadata__"]
            for n in fragments
        )
    out = tmp_path / "merged"
    with simulated():  # on a machine with a GPU, as lock-step's LoRA export
        export(run.url, out)
    assert_merged_export(out, tiny_model_dir, 12)
    # The exported adapters are the final version's.
    key = RunKey.from_hex(key_path(run.url).read_text()).for_run("lagged") if sharded else None
    final = versions.load_params(run, versions.read_version(run, ROUNDS), key)
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    # (peft saves them under the PeftModel's names, without the adapter's name "default")
    ours = {name.replace(".default.", "."): value for name, value in final.items()}
    theirs = {name.removeprefix("base_model.model."): value for name, value in saved.items()}
    assert set(ours) == set(theirs) and all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_a_lora_learner_on_another_base_is_refused_though_version_0_exists(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A version holds the adapters alone: a learner that joins after version 0 must still prove that the
    frozen base it adapts is the run's (here the run recorded another model's digest)."""
    config = lora_config(tmp_path, "other-base", tiny_model_dir, mode="decoupled")
    run = create(config)
    torch.manual_seed(config.seed)
    adapters = {n: p.detach() for n, p in load_model(config.model, tiny_model_dir).model.named_parameters()}
    adapters = {n: p for n, p in adapters.items() if "lora_" in n}
    assert versions.commit(run, versions.Version(0, versions.writer_token()), adapters, None, None)
    assert checkpoint.agree_on_initial_weights(run, "0" * 64)  # another model's
    with replicas_on_the_simulated_accelerator():
        learner = start_replica(run, 0, tmp_path / "learner-0.log")
        assert wait_all([learner]) != [0]
    assert ran_on_the_simulated_accelerator(tmp_path)
    log = (tmp_path / "learner-0.log").read_text()
    assert "InitialWeightsError" in log and "initial weights differ" in log
    assert newest_version(run) == 0 and run.list(layout.contributions(0)) == []
