"""benchmarks/harvest_live.py: what it reads of a finished run, and that a difference between runs is found
(the runs themselves are the benchmark's; tests/harvest/test_live_harvest.py runs one in the suite)."""

from __future__ import annotations

import json

from bench_scripts import load_script

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore

bench = load_script("harvest_live")


def _finished_run(run: ObjectStore, loss: float) -> None:
    run.put(layout.harvested_pairs(1), b'{"prompt": "p", "chosen": "5", "rejected": "6", "provenance": {}}\n')
    report = {"pairs": 1, "prompts": 2, "spent_exact": "1/1000", "pairs_file": layout.harvested_pairs(1)}
    run.put(layout.harvest_report(1), json.dumps(report).encode())
    run.put(
        layout.harvest_report(2), json.dumps({"pairs": 0, "skipped": "too late", "spent_exact": "0"}).encode()
    )
    taken = {
        "round": 2,
        "harvest_of": 1,
        "take": True,
        "outcome": "pairs",
        "detail": "1 pairs",
        "decided_by": 0,
    }
    run.put(layout.harvest_taken(2), json.dumps(taken).encode())
    for rank in (0, 1):
        for j, new in ((1, []), (2, [layout.harvested_pairs(1)]), (3, [])):
            row = {"rank": rank, "round": j, "train": {}, "train_loss": loss, "replay_files": []}
            row["replay_files_new"] = new
            if j == 2:
                row["harvest_wait_s"] = 0.5 + rank
            run.put(layout.metrics(rank, j), json.dumps(row).encode())


def test_what_is_compared_and_what_is_only_reported(tmp_path):
    one, two = ObjectStore(str(tmp_path / "one")), ObjectStore(str(tmp_path / "two"))
    _finished_run(one, 0.5)
    _finished_run(two, 0.5)
    first, second = bench.outcome(one, 3), bench.outcome(two, 3)
    assert first["reports"]["1"]["pair_rows"] == [["p", "5", "6"]]
    assert first["reports"]["2"]["skipped"] == "too late"
    assert first["taken"] == {"2": {"harvest_of": 1, "take": True, "outcome": "pairs"}}
    assert first["waits"] == {"0": {"2": 0.5}, "1": {"2": 1.5}}
    second["waits"] = {"0": {"2": 9.0}, "1": {"2": 9.0}}  # waits are reported, not compared
    assert bench.compare([first, second]) == {"reports": True, "taken": True, "rows": True}

    _finished_run(two, 0.25)  # another training loss: the pairs fed it differently
    assert bench.compare([first, bench.outcome(two, 3)]) == {"reports": True, "taken": True, "rows": False}
