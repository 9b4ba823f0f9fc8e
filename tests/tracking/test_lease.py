"""Two relays of one run (`status` run while the launcher watches): only the lease holder logs; once it gives
the lease up, the other goes on from the holder's cursor, so every step is logged once."""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from composer_serverless.config import validate_config
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.tracking.relay import Relay


def _write_round(run: ObjectStore, k: int, replicas: int = 2, h: int = 2) -> None:
    for rank in range(replicas):
        steps = [{"loss": float(10 * k + i), "time_s": {"sync": 0.0}} for i in range(h)]
        row = {
            "rank": rank,
            "round": k,
            "participants": list(range(replicas)),
            "step_rows": steps,
            **{"bytes_up": 1, "bytes_down": 1, "time_s": {"sync": 0.0}, "blocked_s": 0.0, "round_s": 1.0},
        }
        run.put(layout.metrics(rank, k), json.dumps(row).encode())


def test_only_the_lease_holder_relays_and_the_next_goes_on_from_its_cursor(tmp_path) -> None:
    config = validate_config(
        {
            "run_id": "leased",
            "store": str(tmp_path / "store"),
            "model": {"tiny": {}},
            "diloco": {"replicas": 2, "sync_every": 2, "rounds": 3},
            "tracking": {"report_to": ["tensorboard"], "dir": str(tmp_path / "relay")},
        }
    )
    run = ObjectStore(str(tmp_path / "store")).child("leased")
    _write_round(run, 1)
    watching, status = Relay(run, config), Relay(run, config)
    assert watching.catch_up(ended=False) == 2  # round 1's two steps
    _write_round(run, 2)
    assert status.catch_up(ended=False) == 0, "the watching relay holds the lease"
    watching.close()  # the launcher detached
    _write_round(run, 3)
    assert status.catch_up(ended=True) == 4  # rounds 2 and 3, nothing of round 1 again
    status.close()
    assert json.loads(run.get(layout.TRACKING_RELAYED)) == {"tensorboard": 3}
    events = EventAccumulator(str(run.local_dir(layout.TRACKING_TENSORBOARD)), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 10.0),
        (2, 11.0),
        (3, 20.0),
        (4, 21.0),
        (5, 30.0),
        (6, 31.0),
    ]
