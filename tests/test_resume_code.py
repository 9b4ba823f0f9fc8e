"""A resume runs the code the run shipped: a reward edited since is refused, file by file, before anything
is written; with ``--set code.accept_changes=true`` the replicas run it as it is now and the run records the
change (``config-changes.json``, ``code.json``)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest

from composer_serverless.cli import run as cli_run
from tests.conftest import ran_on_the_simulated_accelerator, replicas_on_the_simulated_accelerator
from tests.test_own_task import MY_TASK, write_task

# The reward edited after the run's first round: a constant no mean of 0/1 rewards over 8 completions is.
EDITED = MY_TASK + "\n\ndef accuracy(prompts, completions, **kwargs):\n    return [0.3] * len(completions)\n"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _reward_by_round(run: Path) -> dict[int, list[float]]:
    """rollout/reward/accuracy of each trained round, one value per replica."""
    out: dict[int, list[float]] = {}
    for path in sorted((run / "metrics").glob("*/*.json")):
        row = json.loads(path.read_text())
        if row["round"] > 0:
            out.setdefault(row["round"], []).append(row["train"]["rollout/reward/accuracy"])
    return out


@pytest.mark.slow
def test_a_resume_after_editing_the_reward_exits_2_and_with_the_setting_runs_it_and_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_task(tmp_path, store=str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    with replicas_on_the_simulated_accelerator():
        assert cli_run(["launch", str(config), "--set", "run_id=own", "--set", "diloco.rounds=1"]) == 0
    run = tmp_path / "runs" / "own"
    old, new = _sha256(MY_TASK), _sha256(EDITED)
    assert json.loads((run / "code.json").read_text()) == {"files": {"my_task.py": old}}
    capsys.readouterr()

    (tmp_path / "my_task.py").write_text(EDITED)
    before = _files(run)
    assert cli_run(["launch", "--resume", str(run), "--set", "diloco.rounds=2"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert (
        "error: the run's code changed since it was shipped, and a resume runs the code the rounds before it "
        f"ran with: my_task.py: sha256 {old[:12]} -> {new[:12]} fix: undo the changes to resume with that "
        "code; or, to run the code as it is now from the resumed round on (on every backend), resume with "
        "--set code.accept_changes=true, which records each changed file in the run's config-changes.json"
    ) in err
    assert _files(run) == before  # nothing written, nothing started

    resume = ["launch", "--resume", str(run), "--set", "diloco.rounds=2", "--set", "code.accept_changes=true"]
    with replicas_on_the_simulated_accelerator():
        assert cli_run(resume) == 0, capsys.readouterr().err
    assert ran_on_the_simulated_accelerator(run / "logs")
    out = " ".join(capsys.readouterr().out.split())
    assert "from round 2 on, the replicas run it as it is now (code.accept_changes): my_task.py" in out
    recorded = [(1, {"diloco.rounds": {"from": 1, "to": 2}, "code/my_task.py": {"from": old, "to": new}})]
    changes = json.loads((run / "config-changes.json").read_text())["changes"]
    assert [(c["round"], c["changes"]) for c in changes] == recorded
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds_committed"] == 2
    assert [(c["round"], c["changes"]) for c in summary["config_changes"]] == recorded
    assert json.loads((run / "code.json").read_text()) == {"files": {"my_task.py": new}}
    # For this resume only: the next one compares again.
    assert json.loads((run / "run.json").read_text())["code"]["accept_changes"] is False
    # The replicas ran the edited reward from the resumed round on, and the original before it.
    rewards = _reward_by_round(run)
    assert rewards[2] == pytest.approx([0.3, 0.3])
    assert all(r != pytest.approx(0.3) for r in rewards[1])


def test_a_new_run_with_code_accept_changes_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_task(tmp_path, store=str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    assert cli_run(["launch", str(config), "--set", "code.accept_changes=true", "--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "error: code.accept_changes is for `launch --resume RUN`: it lets a resume run code that changed since "
        "the run shipped it, and a new run ships its code as it is fix: drop code.accept_changes"
    ) in err


@pytest.mark.parametrize("authenticate", [False, True], ids=["plain", "authenticated"])
def test_accepted_code_is_shipped_again_to_replicas_that_fetch_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, authenticate: bool
) -> None:
    """HF Jobs replicas fetch the code the launch uploaded: a resume that accepts changed code uploads it
    again, with its manifest (MACed with the run key when the run is authenticated), before any replica
    starts, so they fetch what the other backends run."""
    from rich.console import Console

    from composer_serverless.config import validate_config
    from composer_serverless.executors import shipment
    from composer_serverless.launch.launcher import CodeNow, _reconfigure
    from composer_serverless.rendezvous import config_changes, runkey, shipped
    from composer_serverless.rendezvous.store import ObjectStore

    (tmp_path / "my_task.py").write_text(MY_TASK)
    first = shipment.Shipment(tmp_path, ("my_task.py",), (), ())
    run = ObjectStore(f"file://{tmp_path}/runs/own")
    key = runkey.RunKey.generate() if authenticate else None
    if key is not None:  # the key the launcher would find again on a resume
        monkeypatch.setenv(runkey.ENV, key.hex())
        runkey.record_fingerprint(run, key)
    replicas_key = None if key is None else key.for_run("own")
    shipment.upload(run, first, code=True, key=replicas_key)
    shipped.record(run, shipped.digests(tmp_path, first.code))
    (tmp_path / "my_task.py").write_text(EDITED)
    now = shipped.digests(tmp_path, first.code)
    changed = shipped.compare(shipped.recorded(run) or {}, now)
    assert changed == {"my_task.py": (_sha256(MY_TASK), _sha256(EDITED))}
    created = validate_config(
        {
            "run_id": "own",
            "store": f"file://{tmp_path}/runs",
            "model": {"path": str(tmp_path / "model")},
            "diloco": {"replicas": 1, "sync_every": 1, "rounds": 1, "authenticate": authenticate},
        }
    )
    out = io.StringIO()
    _reconfigure(run, created, created, {}, 1, Console(file=out), CodeNow(first, True, now, now, changed))
    assert "from round 2 on, the replicas run it as it is now" in " ".join(out.getvalue().split())
    # What a replica fetches, checked against the manifest (and its MAC, with the run's key).
    assert (shipped.fetch(run, tmp_path / "fetched", replicas_key) / "my_task.py").read_text() == EDITED
    assert shipped.recorded(run) == {"my_task.py": _sha256(EDITED)}
    assert [c["changes"] for c in config_changes.read(run)] == [
        {"code/my_task.py": {"from": _sha256(MY_TASK), "to": _sha256(EDITED)}}
    ]
