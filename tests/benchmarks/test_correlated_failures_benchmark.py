"""benchmarks/correlated_failures.py: its argument checks, the runs it configures, and the poisoned input it
writes (one the exchange really rejects). Its launches are the benchmark; the kill-all launch is also a test
of its own (tests/test_correlated_failures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load_script

from composer_serverless.config import load_config
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.codec import PayloadError, measure, read_header
from composer_serverless.rendezvous.robust import outliers
from composer_serverless.rendezvous.store import ObjectStore

bench = load_script("correlated_failures")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "7"], "at least 8"),
        (["--config", "nowhere.toml"], "not found"),
        (["--config", "deploy/configs/local-composer.toml"], "train.objective 'lm'"),
    ],
)
def test_bad_arguments_fail_up_front(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_every_run_averages_every_replica_in_every_round(tmp_path: Path) -> None:
    """Timing must not decide a run's result: min_replicas = N, and the scenario's own settings on top."""
    base = load_config("deploy/configs/local-demo.toml")
    config = bench.configured(base, 8, 0, "x", f"file://{tmp_path}/runs", checkpoint_every=2)
    assert config.diloco.min_replicas == config.diloco.replicas == 4
    assert config.diloco.checkpoint_every == 2 and config.diloco.rounds == 8
    assert config.executor.max_restarts >= 1 and config.eval.every_rounds == 1
    assert (config.data.seq_len, config.data.batch_size) == (base.data.seq_len, base.data.batch_size)


def test_the_poisoned_input_is_one_the_exchange_leaves_out(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The input ``poison`` writes is well-formed (its checksum and stated norm hold) and so large against
    three ordinary contributions that the robust average leaves it out."""
    run = ObjectStore(f"file://{tmp_path}/run-x")
    run.upload_dir(tiny_model_dir, layout.MODEL)
    for rank in range(4):
        run.put(layout.heartbeat(rank), json.dumps({"rank": rank, "state": "training", "round": 2}).encode())
    events: list[dict] = []
    bench.poison(run, 3, 1, 4, events)
    assert events and events[0]["written_first"]
    payload = run.get(events[0]["key"])
    identity = {"run_id": "run-x", "round": "3", "fragment": "0", "local": "0", "rank": "1", "shard": "0"}
    header, _ = read_header(payload)
    shard_numel = int(header["__metadata__"]["numel"])
    measured = measure(payload, identity, "fp32", shard_numel)
    assert measured.norm == measured.whole > 1e30
    assert list(outliers({0: 1.0, 1: measured.whole, 2: 1.2, 3: 0.9}, 10.0, 4)) == [1]
    with pytest.raises(PayloadError):  # nor does it pass as any other replica's
        measure(payload, {**identity, "rank": "2"}, "fp32", shard_numel)
