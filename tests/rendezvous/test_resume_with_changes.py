"""``launch --resume RUN --set key=value``: a finished run extended to a later end ends bit-identical to the
longer run launched at once; a new train.lr takes effect from the resumed round; every other key is refused
with why, and nothing is written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness import create, digests, logs_of, make_config, rows, start_replica, wait_all
from typer.testing import CliRunner

from composer_serverless.cli import app
from composer_serverless.config import RunConfig, validate_config
from composer_serverless.executors.base import LaunchRecord, ReplicaHandle, ReplicaStatus
from composer_serverless.launch.report import write_report
from composer_serverless.rendezvous import config_changes, layout
from composer_serverless.rendezvous.store import ObjectStore

WEIGHTS = f"{layout.FINAL}/model.safetensors"


def _config(store: str, run_id: str, model_dir: Path, rounds: int) -> RunConfig:
    """Two replicas that always sync together, a constant learning rate after warm-up (the schedule does not
    depend on the run's length), evaluated and checkpointed every 3 rounds: an N = 2 round run evaluates and
    checkpoints round 2 (its last), the 4-round run does not."""
    base = make_config(store, run_id, model_dir, rounds=rounds, min_replicas=2, checkpoint_every=3)
    raw = json.loads(base.resolved_json())
    raw["train"]["schedule"] = "constant"
    raw["eval"]["every_rounds"] = 3
    return validate_config(raw)


def _resume(run: ObjectStore, *sets: str) -> tuple[int, str]:
    argv = ["launch", "--resume", run.url, *(a for s in sets for a in ("--set", s))]
    result = CliRunner().invoke(app, argv)
    return result.exit_code, " ".join(result.output.split())  # rich wraps long lines


@pytest.fixture(scope="module")
def extended(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Any]:
    """A 4-round run, and a 2-round run (finished, with its report) resumed with --set diloco.rounds=4."""
    root = tmp_path_factory.mktemp("extended")
    store = f"file://{root}/runs"
    long = create(_config(store, "long", tiny_model_dir, rounds=4))
    short = create(_config(store, "short", tiny_model_dir, rounds=2))
    logs = root / "logs"
    logs.mkdir()
    runs = {"long": long, "short": short}
    procs = [start_replica(run, r, logs / f"{name}-{r}.log") for name, run in runs.items() for r in range(2)]
    assert wait_all(procs) == [0] * 4, logs_of(logs)
    write_report(short, RunConfig.model_validate_json(short.get(layout.RUN_CONFIG)), 1.0)
    assert short.exists(layout.SUMMARY) and "eval" in rows(short)[0][2]
    short_weights = short.get(WEIGHTS)
    code, output = _resume(short, "diloco.rounds=4")
    assert code == 0, output + logs_of(short.local_dir("logs"))
    return {"long": long, "short": short, "output": output, "weights_at_2": short_weights}


@pytest.mark.slow
def test_a_finished_run_extended_by_a_resume_ends_bit_identical_to_the_longer_run(
    extended: dict[str, Any],
) -> None:
    long, short, output = extended["long"], extended["short"], extended["output"]
    assert "resuming run short from its checkpoint of round 2" in output
    assert "changed in run.json from round 3 on: diloco.rounds 2 -> 4" in output
    assert "cosine" not in output  # a constant schedule does not depend on the run's length
    # Round 2 was evaluated and checkpointed in the 2-round run (its last) and not in the 4-round run: neither
    # changes the state.
    assert "eval" in rows(short)[0][2] and "eval" not in rows(long)[0][2]
    assert not long.exists(layout.replica_state(0, 2))
    assert digests(short) == digests(long) and set(digests(long)) == {1, 2, 3, 4}
    assert all(len(d) == 1 for d in digests(long).values())
    assert short.get(WEIGHTS) == long.get(WEIGHTS) != extended["weights_at_2"]
    summary = json.loads(short.get(layout.SUMMARY))  # the new end's report
    assert summary["rounds"] == 4 and summary["rounds_committed"] == 4
    assert [(c["round"], c["changes"]) for c in summary["config_changes"]] == [
        (2, {"diloco.rounds": {"from": 2, "to": 4}})
    ]
    assert RunConfig.model_validate_json(short.get(layout.RUN_CONFIG)) == RunConfig.model_validate_json(
        long.get(layout.RUN_CONFIG)
    ).model_copy(update={"run_id": "short"})


@pytest.mark.slow
def test_a_new_learning_rate_takes_effect_from_the_resumed_round(extended: dict[str, Any]) -> None:
    short = extended["short"]
    code, output = _resume(short, "diloco.rounds=5", "train.lr=0.004")
    assert code == 0, output + logs_of(short.local_dir("logs"))
    assert "train.lr 0.01 -> 0.004" in output
    for by_round in rows(short).values():
        assert by_round[4]["lr"] == 0.01 and by_round[5]["lr"] == 0.004
    assert [c["round"] for c in config_changes.read(short)] == [2, 4]
    assert RunConfig.model_validate_json(short.get(layout.RUN_CONFIG)).train.lr == 0.004


def _finished(tmp_path: Path, model_dir: Path) -> ObjectStore:
    run = create(make_config(f"file://{tmp_path}/runs", "done", model_dir))
    run.put(layout.SUMMARY, json.dumps({"rounds_committed": 4}).encode())
    return run


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (("diloco.rounds=6", "model.dtype='bfloat16'"), "model.dtype: the saved states"),
        (("diloco.rounds=6", "seed=1"), "seed: the initial weights and the data order"),
        (("diloco.rounds=6", "diloco.outer_lr=0.5"), "diloco.outer_lr: the outer optimizer's saved state"),
        (("diloco.rounds=6", "diloco.replicas=3"), "diloco.replicas: each replica's share of the data"),
        (("diloco.rounds=3",), "diloco.rounds: a resume only extends a run: it was set to 4 rounds"),
        (("train.lr=0.001",), "has finished its 4 rounds"),
        (("diloco.rounds=six",), "diloco.rounds: Input should be a valid integer"),
    ],
)
def test_a_refused_change_exits_2_and_writes_nothing(
    tmp_path: Path, tiny_model_dir: Path, sets: tuple[str, ...], says: str
) -> None:
    run = _finished(tmp_path, tiny_model_dir)
    before = {key: run.get(key) for key in run.list_tree()}
    code, output = _resume(run, *sets)
    assert code == 2 and says in output, output
    assert {key: run.get(key) for key in run.list_tree()} == before


def test_the_refusal_says_how_to_get_what_was_asked(tmp_path: Path, tiny_model_dir: Path) -> None:
    code, output = _resume(_finished(tmp_path, tiny_model_dir), "data.seq_len=32")
    assert code == 2
    assert "a resume may change diloco.checkpoint_every" in output and "train.lr" in output
    assert "launch a new run from this one's model (`composer-serverless export RUN OUT`" in output
    code, output = _resume(_finished(tmp_path / "again", tiny_model_dir), "train.lr=0.001")
    assert code == 2 and "--set diloco.rounds=<more than 4> trains it further" in output


def test_a_change_is_refused_while_a_replica_is_live(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Live replicas have read run.json: --set never rewrites it under them (a plain resume adopts them)."""
    from composer_serverless.executors import make_executor
    from composer_serverless.executors.local import LocalProcessExecutor

    config = make_config(f"file://{tmp_path}/runs", "live", tiny_model_dir)
    run = create(config)
    plan = make_executor(config, run).plan(config, run.url)
    handles = tuple(ReplicaHandle(rank, str(1000 + rank)) for rank in range(2))
    run.put(layout.LAUNCH_RECORD, LaunchRecord(plan, handles).to_json())
    states = {0: "running", 1: "failed"}
    monkeypatch.setattr(
        LocalProcessExecutor,
        "status",
        lambda self, asked: [ReplicaStatus(h.rank, states[h.rank]) for h in asked],  # type: ignore[misc]
    )
    before = run.get(layout.RUN_CONFIG)
    code, output = _resume(run, "train.lr=0.001")
    assert code == 2 and "still has live replicas (0)" in output and "cancel the run" in output, output
    assert run.get(layout.RUN_CONFIG) == before and not run.exists(layout.CONFIG_CHANGES)


def test_the_record_of_changes_reads_back_and_survives_garbage(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path))
    assert config_changes.read(store) == []
    config_changes.record(store, 2, {"diloco.rounds": (2, 4)})
    config_changes.record(store, 4, {"train.lr": (0.01, 0.004)})
    read = config_changes.read(store)
    assert [(c["round"], c["changes"]) for c in read] == [
        (2, {"diloco.rounds": {"from": 2, "to": 4}}),
        (4, {"train.lr": {"from": 0.01, "to": 0.004}}),
    ]
    store.put(layout.CONFIG_CHANGES, b"\x00garbage")
    assert config_changes.read(store) == []
