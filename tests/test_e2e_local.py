"""End to end: the launcher, the local executor and two subprocess replicas, two rounds, a real store."""

import io
import json
from pathlib import Path

import matplotlib.image
import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer_serverless.config import validate_config
from composer_serverless.launch.launcher import launch
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import read_metrics
from tests.conftest import TINY, cli_in_fresh_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    config = validate_config(
        {
            "run_id": "e2e",
            "store": str(store),
            "model": {"tiny": TINY.model_dump()},
            "data": {"seq_len": 32, "batch_size": 4},
            "train": {"lr": 1e-2},
            "diloco": {"replicas": 2, "sync_every": 3, "rounds": 2},
            "eval": {"sequences": 8},
            "executor": {"threads_per_replica": 1},
        }
    )
    output = io.StringIO()
    summary = launch(config, "e2e.toml", Console(file=output, width=120))
    return ObjectStore(str(store)).child("e2e"), summary, output.getvalue()


def test_summary_reports_the_run(finished_run):
    run, summary, output = finished_run
    assert json.loads(run.get("summary.json")) == summary
    assert summary["run_id"] == "e2e" and summary["replicas"] == 2 and summary["sync_every"] == 3
    assert summary["rounds_committed"] == 2
    for key in ("initial_eval_loss", "final_eval_loss"):
        assert torch.isfinite(torch.tensor(summary[key]))
    # Reduce-scatter with 2 replicas: each uploads its 2 shards and the reduced shard it owns (1.5 payloads)
    # and reads the peer's input of its shard and the other reduced shard (1 payload; plus a small quorum).
    assert summary["bytes_downloaded"] > 0
    # Beside them, each replica publishes its norm record once a sync and each shard's owner reads both
    # replicas' records (the outlier rule, rendezvous/norms.py).
    norms = sum(p.stat().st_size for p in Path(run.url).glob("rounds/*/*/*/norm/*.json"))
    assert norms > 0
    payload_up, payload_down = summary["bytes_uploaded"] - norms, summary["bytes_downloaded"] - 2 * norms
    assert payload_up == pytest.approx(1.5 * payload_down, rel=1e-3)
    assert summary["wall_s"] > 0
    assert "held-out loss of the global model" in output and "summary.json" in output


def test_training_loss_is_finite_and_replicas_agree_bit_for_bit(finished_run):
    run, summary, _ = finished_run
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1]
    for rows in metrics.values():
        trained = [r for r in rows if r["round"] > 0]
        assert [r["round"] for r in trained] == [1, 2]
        assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in trained)
    by_rank = {
        rank: {r["round"]: r["global_sha256"] for r in rows if r["round"] > 0}
        for rank, rows in metrics.items()
    }
    assert by_rank[0] == by_rank[1], "replicas disagree on the global parameters after a sync"
    assert by_rank[0][1] != by_rank[0][2]
    assert summary["replicas_bit_identical"] is True


def test_every_parameter_changed_and_final_model_loads(finished_run):
    run, _, _ = finished_run
    initial = load_file(run.local_dir("model") / "model.safetensors")
    final_dir = run.local_dir("final")
    final = AutoModelForCausalLM.from_pretrained(final_dir)
    AutoTokenizer.from_pretrained(final_dir)
    unchanged = [
        name
        for name, tensor in final.state_dict().items()
        if name in initial and torch.equal(tensor, initial[name])
    ]
    assert not unchanged


def test_loss_plot_is_a_png(finished_run):
    run, _, _ = finished_run
    image = matplotlib.image.imread(run.local_dir("loss.png"))
    assert image.ndim == 3 and image.shape[0] > 100


def test_replica_logs_are_kept_per_rank(finished_run):
    run, _, _ = finished_run
    logs = sorted(p.name for p in run.local_dir("logs").iterdir())
    assert logs == ["rank-0.log", "rank-1.log"]
    assert "round 2/2" in (run.local_dir("logs") / "rank-1.log").read_text()


def test_status_of_the_finished_run_names_its_outcome_without_the_training_stack(finished_run):
    run, summary, _ = finished_run
    result, loaded = cli_in_fresh_process("status", run.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("succeeded") == 2
    initial, final = summary["initial_eval_loss"], summary["final_eval_loss"]
    assert f"finished: held-out loss of the global model: {initial:.4f} -> {final:.4f}" in result.stdout
    assert loaded == []
