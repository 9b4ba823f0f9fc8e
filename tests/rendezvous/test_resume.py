"""A run whose replicas all die is resumed with ``composer-serverless launch --resume RUN`` and ends with
global parameters bit-identical to a run that was never interrupted."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from harness import (
    REFERENCE_SETTINGS,
    REPO,
    ReferenceRun,
    create,
    digests,
    logs_of,
    make_config,
    resume_in_a_process,
    rows,
    run_replicas,
)

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.latest import latest_round
from composer_serverless.rendezvous.store import ObjectStore
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator


@pytest.mark.slow
def test_interrupted_and_resumed_run_is_bit_identical(
    tmp_path: Path, tiny_model_dir: Path, reference_run: ReferenceRun
) -> None:
    """On the accelerator's path (the simulated one), against the reference run on the CPU: killed, resumed,
    and bit-identical to it, so the device path computes exactly what the CPU path does."""
    interrupted = create(
        make_config(f"file://{tmp_path}/runs", "interrupted", tiny_model_dir, **REFERENCE_SETTINGS)
    )
    # Both replicas SIGKILL themselves when they start uploading in round 4, one inner step into it.
    kill = {r: json.dumps({"kill_on": "rounds/4/0/0/in/"}) for r in range(2)}
    with replicas_on_the_simulated_accelerator():
        assert run_replicas(interrupted, tmp_path / "logs", 2, kill) == [-signal.SIGKILL] * 2
        assert latest_round(interrupted) == 3
        cli = resume_in_a_process(interrupted)
    assert cli.returncode == 0, cli.stdout + cli.stderr + logs_of(tmp_path / "logs")
    assert "resuming run interrupted" in cli.stdout
    assert ran_on_the_simulated_accelerator(tmp_path / "logs")
    assert ran_on_the_simulated_accelerator(interrupted.local_dir("logs"))

    assert logs_of(interrupted.local_dir("logs")).count("resumed from round 3 (own state of round 3)") == 2
    assert latest_round(interrupted) == 5
    resumed = digests(interrupted)
    assert set(resumed) == {1, 2, 3, 4, 5}
    assert resumed == reference_run.digests
    assert final_eval(interrupted) == final_eval(reference_run.run)


def final_eval(run: ObjectStore) -> float:
    """The held-out loss of the final global model, from whichever replica evaluated it."""
    return next(
        by_round[5]["eval"]["eval/loss"] for by_round in rows(run).values() if "eval" in by_round.get(5, {})
    )


def test_resume_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    """--resume takes the run's config from its store (changed only by --set: test_resume_with_changes.py), and
    only a run: exit 2 before anything is started."""
    from typer.testing import CliRunner

    from composer_serverless.cli import app

    def run(*argv: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, list(argv))
        return result.exit_code, " ".join(result.output.split())  # rich wraps long lines

    demo = str(REPO / "deploy" / "configs" / "local-demo.toml")
    for argv in (
        ("launch", demo, "--resume", str(tmp_path)),
        ("launch", "--resume", str(tmp_path), "--replicas", "3"),
    ):
        code, output = run(*argv)
        assert code == 2 and "--resume continues a run with the config in its store" in output
    code, output = run("launch", "--resume", str(tmp_path / "nothing"))
    assert code == 2 and "is not a run" in output
    code, output = run("launch")
    assert code == 2 and "missing CONFIG" in output
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_a_resume_from_an_older_checkpoint_redoes_the_later_rounds_bit_identically(
    tmp_path: Path, tiny_model_dir: Path, reference_run: ReferenceRun
) -> None:
    """Checkpoints every 2 rounds: killed in round 4, the run resumes from its checkpoint of round 2, redoes
    rounds 3 to 5 and ends as the uninterrupted run (which checkpointed every round) did."""
    settings = {**REFERENCE_SETTINGS, "checkpoint_every": 2}
    interrupted = create(make_config(f"file://{tmp_path}/runs", "sparse", tiny_model_dir, **settings))
    kill = {r: json.dumps({"kill_on": "rounds/4/0/0/in/"}) for r in range(2)}
    assert run_replicas(interrupted, tmp_path / "logs", 2, kill) == [-signal.SIGKILL] * 2
    assert latest_round(interrupted) == 2 and interrupted.exists("rounds/3/0/quorum.json")

    cli = resume_in_a_process(interrupted)
    assert cli.returncode == 0, cli.stdout + cli.stderr + logs_of(tmp_path / "logs")
    assert "from its checkpoint of round 2" in cli.stdout
    assert logs_of(interrupted.local_dir("logs")).count("resumed from round 2 (own state of round 2)") == 2
    assert digests(interrupted) == reference_run.digests
    assert final_eval(interrupted) == final_eval(reference_run.run)


def _resume(run: ObjectStore) -> tuple[int, str]:
    from typer.testing import CliRunner

    from composer_serverless.cli import app

    result = CliRunner().invoke(app, ["launch", "--resume", run.url])
    return result.exit_code, " ".join(result.output.split())


def test_resuming_a_finished_run_says_it_is_finished(tmp_path: Path, tiny_model_dir: Path) -> None:
    run = create(make_config(f"file://{tmp_path}/runs", "done", tiny_model_dir))
    run.put(layout.SUMMARY, json.dumps({"rounds_committed": 4}).encode())
    code, output = _resume(run)
    assert code == 2 and "has finished" in output and "nothing to resume" in output, output
    assert not run.exists(layout.LAUNCH_RECORD)  # nothing was started


def test_a_resume_with_no_intact_state_exits_2_and_starts_nothing(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run = create(make_config(f"file://{tmp_path}/runs", "broken", tiny_model_dir))
    run.put(f"{layout.global_state(2)}/tensors.safetensors", b"partial")  # died while writing, no manifest
    run.put(layout.CHECKPOINT, json.dumps({"round": 2}).encode())
    code, output = _resume(run)
    assert code == 2 and "cannot resume" in output and "state/2: part 0 has no manifest" in output, output
    assert not run.exists(layout.LAUNCH_RECORD)
    assert run.exists(f"{layout.global_state(2)}/tensors.safetensors")  # nothing deleted either


def test_a_resumed_run_reports_the_wall_time_of_all_its_launches(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The first launch ran 30 s (to its replicas' last heartbeat) after an earlier 5 s: the resumed
    launch's record starts from 35 s, not from zero, and the dead time before the resume is not counted."""
    import time

    from composer_serverless.executors import make_executor
    from composer_serverless.executors.base import LaunchRecord
    from composer_serverless.launch.launcher import _wall_so_far
    from composer_serverless.rendezvous.telemetry import Reporter

    config = make_config(f"file://{tmp_path}/runs", "walls", tiny_model_dir)
    run = create(config)
    plan = make_executor(config, run).plan(config, run.url)
    now = time.time()
    record = LaunchRecord(plan, (), created_at=now - 30.0, earlier_wall_s=5.0)
    run.put(layout.LAUNCH_RECORD, record.to_json())
    Reporter(run, 0).beat(state="failed")  # its last heartbeat: now
    assert _wall_so_far(run) == pytest.approx(35.0, abs=2.0)
    assert LaunchRecord.from_json(record.to_json()).earlier_wall_s == 5.0


@pytest.mark.slow
def test_a_resume_whose_newest_checkpoint_was_destroyed_continues_from_the_one_before(
    tmp_path: Path, tiny_model_dir: Path, reference_run: ReferenceRun
) -> None:
    """Killed in round 4 with checkpoints every round; then the newest checkpoint's tensors are truncated and
    LATEST is overwritten with garbage. The resume passes over state 3, says so, and continues from the
    checkpoint before it (round 2, kept with every replica's own state: ``keep_checkpoints`` 2), ending as the
    uninterrupted run did, to the bit."""
    run = create(make_config(f"file://{tmp_path}/runs", "damaged", tiny_model_dir, **REFERENCE_SETTINGS))
    kill = {r: json.dumps({"kill_on": "rounds/4/0/0/in/"}) for r in range(2)}
    assert run_replicas(run, tmp_path / "logs", 2, kill) == [-signal.SIGKILL] * 2
    run.put(f"{layout.global_state(3)}/tensors.safetensors", b"truncated")
    run.put(layout.LATEST, b"\x00\xffgarbage")
    cli = resume_in_a_process(run)
    assert cli.returncode == 0, cli.stdout + cli.stderr + logs_of(tmp_path / "logs")
    output = " ".join(cli.stdout.split())
    assert "passing over state/3: tensors.safetensors of part 0 is 9 bytes" in output
    assert "from its checkpoint of round 2" in output
    assert "LATEST is not a round pointer" in cli.stderr
    assert latest_round(run) == 5
    assert digests(run) == reference_run.digests
    assert final_eval(run) == final_eval(reference_run.run)
