"""A composer run harvested live: the launcher asks fake teachers about the replicas' rollouts between rounds,
the replicas replay the pairs from the next round boundary on, every round's row says which pair files it
replayed, the spend stays under the run's cap, and the teachers' key reaches no replica, log or object."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from fractions import Fraction
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from composer_serverless.config import validate_config
from composer_serverless.harvest import live
from composer_serverless.launcher import launch
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from tests.harvest.conftest import CANARY
from tests.harvest.fake_teacher import Behaviour

pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parents[2] / "deploy" / "data" / "composer-tasks"
ROUNDS = 6


def _right_answers() -> dict[str, str]:
    rows = [json.loads(line) for line in (TASKS / "train.jsonl").read_text().splitlines()]
    return {row["prompt"]: row["answer"] for row in rows}


class ReplicaWatch(threading.Thread):
    """Every replica process of the run seen while it runs: its command line and environment."""

    def __init__(self, run_id: str) -> None:
        super().__init__(daemon=True)
        self.run_id = run_id
        self.seen: dict[int, tuple[list[str], dict[str, str]]] = {}
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
            time.sleep(0.2)


def test_a_run_harvested_between_its_rounds(teachers, tmp_path, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", CANARY)
    monkeypatch.setattr(live, "POLL_S", 0.2)  # rounds of a few seconds here, of minutes in a real run
    right = _right_answers()
    fakes = teachers(3, key=CANARY, usd_per_m_input=2.0, usd_per_m_output=8.0)
    for index, fake in enumerate(fakes):
        slip = "0" if index == 2 else ""  # the third teacher is always a little wrong: 2 of 3 agree
        fake.script = lambda prompt, attempt, s=slip: Behaviour(answer=f"The answer is {right[prompt]}{s}.")
    config = validate_config(
        {
            "run_id": "live-harvest",
            "store": str(tmp_path / "runs"),
            "model": {
                "tiny": {
                    "tokenizer": "chars",
                    "alphabet": " -.0123456789:=ATabcdefghilmnoprstvwx",
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_layers": 2,
                    "num_heads": 4,
                }
            },
            "train": {"objective": "composer", "lr": 1e-3},
            "diloco": {"replicas": 2, "sync_every": 8, "rounds": ROUNDS},
            "eval": {"sequences": 7},
            "composer": {
                "alpha": 0.0,
                "beta": 1.0,
                "data": {"prompts": str(TASKS / "train.jsonl"), "heldout": str(TASKS / "heldout.jsonl")},
                "rewards": [{"fn": "exact_match"}],
                "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 4},
                "replay": {"pairs_per_step": 4},
            },
            "harvest": {
                "live": True,
                "max_usd": 0.01,  # about a harvest and a half: the cap binds within the run
                "max_states": 12,  # the student's 12 worst prompts of each round
                "normalise": {"final_answer": r"answer is\s*(\S+)", "trim_chars": "."},
                "teachers": [
                    {
                        "name": name,
                        "base_url": fake.base_url,
                        "model": f"model-{name}",
                        "api_key_env": "TEACHER_KEY",
                        "usd_per_m_input": 2.0,
                        "usd_per_m_output": 8.0,
                        "max_tokens": 32,
                    }
                    for name, fake in zip(("careful", "steady", "sloppy"), fakes, strict=True)
                ],
            },
            "executor": {"type": "local", "threads_per_replica": 1},
        }
    )
    watch = ReplicaWatch("live-harvest")
    watch.start()
    out = io.StringIO()
    try:
        summary = launch(config, "live-harvest", Console(file=out, width=200))
    finally:
        watch.done.set()
        watch.join()
    assert summary is not None and summary["rounds_committed"] == ROUNDS
    run = ObjectStore(str(tmp_path / "runs" / "live-harvest"))

    # Harvests of rounds 1 .. ROUNDS - 2 (later pairs would be replayed by no round), none asked twice.
    reports = {
        int(n[:-5]): json.loads(run.get(f"{layout.HARVEST_REPORTS}/{n}"))
        for n in run.list(layout.HARVEST_REPORTS)
    }
    assert reports and set(reports) <= set(range(1, ROUNDS - 1))
    first = min(reports)
    assert reports[first]["refused"] == 0 and reports[first]["verdicts"] == {
        "agreed": reports[first]["prompts"]
    }
    assert reports[first]["pairs"] > 0
    for k, report in reports.items():
        if not report["pairs"]:
            continue
        pairs = [json.loads(line) for line in run.get(layout.harvested_pairs(k)).decode().splitlines()]
        for pair in pairs:  # the majority's answer over the student's wrong one
            assert pair["chosen"] == right[pair["prompt"]] and pair["rejected"] != pair["chosen"]
            assert pair["provenance"]["agreement"]["voters"] == ["careful", "steady"]
    spent = sum(Fraction(r["spent_exact"]) for r in reports.values())
    assert sum(f.billed for f in fakes) <= spent <= Fraction(0.01)

    # The cap holds over the run: a later harvest got what the earlier ones left (here, not all it wanted).
    assert sum(r["refused"] for r in reports.values()) > 0

    # A round after the first harvest replayed its pairs, and its row says which file they came from.
    rows = [r for r in read_metrics(run)[0] if r["round"] > 0 and "train" in r]
    replaying = [r for r in rows if layout.harvested_pairs(first) in r.get("replay_files", [])]
    assert replaying and all(r["train"]["replay/pairs"] > 0 for r in replaying)
    assert all("replay/pairs" not in r["train"] for r in rows if not r.get("replay_files"))
    assert any(layout.harvested_pairs(first) in r.get("replay_files_new", []) for r in rows)
    assert f"harvest of round {first}:" in out.getvalue()

    # The key stayed with the launcher: no replica's argv or environment, no log, no object holds it.
    assert len(watch.seen) >= 2
    for cmdline, environ in watch.seen.values():
        assert CANARY not in " ".join(cmdline) and CANARY not in json.dumps(environ)
        assert "TEACHER_KEY" not in environ
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert any("/harvest/cache/" in str(p) for p in files) and any(p.name == "rank-0.log" for p in files)
    leaks = [str(p) for p in files if CANARY.encode() in p.read_bytes()]
    assert not leaks and CANARY not in out.getvalue()
