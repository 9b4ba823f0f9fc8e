"""A composer run harvested live: the launcher asks fake teachers about the replicas' rollouts between rounds,
on the fixed schedule (live_lag 1): every round from 1 to rounds - 2 is harvested, in order, and the pairs of
round k are taken by both replicas at the end of round k + 1 and replayed from round k + 2 on. The first
harvest is held by the teachers until both replicas are seen waiting for it, so the replicas' wait is part
of the run, not a matter of the machine's speed. Every round's row says which pair files it replayed and
took, the spend stays under the run's cap, and the teachers' key reaches no replica, log or object."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from fractions import Fraction

import psutil
import pytest
from rich.console import Console

from composer_serverless.harvest import live
from composer_serverless.launch.launcher import launch
from composer_serverless.objectives.harvest_schedule import NO_PAIRS, PAIRS
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_heartbeats, read_metrics
from tests.harvest.conftest import CANARY, live_run_config, right_answers
from tests.harvest.fake_teacher import Behaviour

pytestmark = pytest.mark.slow

ROUNDS = 6
WAITING = "waiting for the harvest of round 1"


class ReplicaWatch(threading.Thread):
    """Every replica process of the run seen while it runs (its command line and environment), and whether
    every replica's heartbeat has said it waits for the first harvest (``both_waiting``)."""

    def __init__(self, run_id: str, run: ObjectStore) -> None:
        super().__init__(daemon=True)
        self.run_id = run_id
        self.store = run
        self.seen: dict[int, tuple[list[str], dict[str, str]]] = {}
        self.waiting: set[int] = set()
        self.both_waiting = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                cmdline = proc.info["cmdline"] or []
                if "composer_serverless.replicas.worker" in cmdline and any(
                    self.run_id in a for a in cmdline
                ):
                    with contextlib.suppress(psutil.Error):
                        self.seen.setdefault(proc.pid, (cmdline, proc.environ()))
            with contextlib.suppress(FileNotFoundError, ValueError):
                beats = read_heartbeats(self.store)
                self.waiting |= {rank for rank, beat in beats.items() if beat.get("state") == WAITING}
            if len(self.waiting) == 2:
                self.both_waiting.set()
            time.sleep(0.1)


def test_a_run_harvested_between_its_rounds_on_a_fixed_schedule(teachers, tmp_path, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", CANARY)
    monkeypatch.setattr(live, "POLL_S", 0.2)  # rounds of a few seconds here, of minutes in a real run
    right = right_answers()
    run = ObjectStore(str(tmp_path / "runs" / "live-harvest"))
    watch = ReplicaWatch("live-harvest", run)
    fakes = teachers(3, key=CANARY, usd_per_m_input=2.0, usd_per_m_output=8.0)
    for index, fake in enumerate(fakes):
        slip = "0" if index == 2 else ""  # the third teacher is always a little wrong: 2 of 3 agree

        def script(prompt, attempt, slip=slip):
            # The first harvest is slower than the replicas: it answers once both wait for it.
            watch.both_waiting.wait(120)
            return Behaviour(answer=f"The answer is {right[prompt]}{slip}.")

        fake.script = script
    # About a harvest and a half: the cap binds within the run. The student's 12 worst prompts a round.
    config = live_run_config(fakes, tmp_path / "runs", "live-harvest", ROUNDS, max_usd=0.01, max_states=12)
    watch.start()
    out = io.StringIO()
    try:
        summary = launch(config, "live-harvest", Console(file=out, width=200))
    finally:
        watch.done.set()
        watch.join()
    assert summary is not None and summary["rounds_committed"] == ROUNDS

    # Rounds 1 .. ROUNDS - 2 harvested, in order, each once (round 5's pairs would be replayed by no round).
    reports = live.harvested_rounds(run)
    assert set(reports) == set(range(1, ROUNDS - 1))
    said = [line.strip().split(":")[0] for line in out.getvalue().splitlines() if "harvest of round" in line]
    assert said == [f"harvest of round {k}" for k in range(1, ROUNDS - 1)]
    first = reports[1]
    assert first["refused"] == 0 and first["verdicts"] == {"agreed": first["prompts"]} and first["pairs"] > 0
    for k, report in reports.items():
        if report["pairs_file"] is None:
            continue
        pairs = [json.loads(line) for line in run.get(layout.harvested_pairs(k)).decode().splitlines()]
        assert len(pairs) == report["pairs"]
        for pair in pairs:  # the majority's answer over the student's wrong one
            assert pair["chosen"] == right[pair["prompt"]] and pair["rejected"] != pair["chosen"]
            assert pair["provenance"]["agreement"]["voters"] == ["careful", "steady"]

    # The cap holds over the run: a later harvest got what the earlier ones left (here, not all it wanted).
    spent = sum(live.counted_spend(run).values())
    assert sum(f.billed for f in fakes) <= spent <= Fraction(0.01)
    assert spent == sum(Fraction(r["spent_exact"]) for r in reports.values())  # every report was written
    assert sum(r.get("refused", 0) for r in reports.values()) > 0

    # Both replicas took the same files at the same rounds: round j's end took the harvest of round j - 1,
    # and the rounds after replayed it; round 3 is the first to replay round 1's pairs.
    files = {k: [layout.harvested_pairs(k)] if r["pairs_file"] else [] for k, r in reports.items()}
    metrics = read_metrics(run)
    assert set(metrics) == {0, 1}
    for rank, rows in metrics.items():
        by_round = {r["round"]: r for r in rows if r["round"] > 0 and "train" in r}
        assert sorted(by_round) == list(range(1, ROUNDS + 1))
        replayed: list[str] = []
        for j, row in by_round.items():
            taken = files.get(j - 1, []) if j >= 2 else []
            assert row["replay_files"] == replayed and row["replay_files_new"] == taken, (rank, j)
            if 2 <= j <= ROUNDS - 1:
                outcome = PAIRS if taken else NO_PAIRS
                assert (row["harvest"]["of_round"], row["harvest"]["outcome"]) == (j - 1, outcome)
            else:
                assert "harvest" not in row and "harvest_wait_s" not in row
            assert ("replay/pairs" in row["train"]) == bool(replayed)
            replayed = replayed + taken
        assert by_round[3]["replay_files"] == [layout.harvested_pairs(1)]
        assert by_round[3]["train"]["replay/pairs"] > 0
        # The first harvest was held until both replicas waited for it: round 2's end waited.
        assert by_round[2]["harvest_wait_s"] > 0
    decided = sorted(run.list(layout.HARVEST_TAKEN))
    assert decided == [layout.harvest_taken(j).rsplit("/", 1)[1] for j in range(2, ROUNDS)]
    assert json.loads(run.get(layout.HARVESTER))["reason"] == "the run ended"

    # The key stayed with the launcher: no replica's argv or environment, no log, no object holds it.
    assert len(watch.seen) >= 2
    for cmdline, environ in watch.seen.values():
        assert CANARY not in " ".join(cmdline) and CANARY not in json.dumps(environ)
        assert "TEACHER_KEY" not in environ
    files_written = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert any("/harvest/cache/" in str(p) for p in files_written)
    assert any(p.name == "rank-0.log" for p in files_written)
    leaks = [str(p) for p in files_written if CANARY.encode() in p.read_bytes()]
    assert not leaks and CANARY not in out.getvalue()
