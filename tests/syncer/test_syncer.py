"""The syncer in this process, on hand-made contributions: its arithmetic on hand-computed numbers, what it
drops and records, and its commit against a second syncer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from composer_serverless.config import ConfigError, validate_config
from composer_serverless.launch.launcher import resume
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.decoupled import Contribution, Version
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.syncer.syncer import Syncer
from tests.rendezvous.harness import create, make_config

LR, MOMENTUM = 0.5, 0.25


def run_of(tmp_path: Path, store: str | None = None, **decoupled: object) -> tuple[ObjectStore, Syncer]:
    """A run of 3 learners in ``store`` (``tmp_path`` unless given) holding version 0, and its syncer."""
    store = store or str(tmp_path)
    config = make_config(
        store,
        "hand",
        tmp_path,
        replicas=3,
        rounds=2,
        mode="decoupled",
        embedding_average="all",
        outer_lr=LR,
        outer_momentum=MOMENTUM,
        outlier_norm_factor=None,
        decoupled={"poll_s": 0.01, **decoupled},
    )
    run = ObjectStore(store).child("hand")
    run.put(layout.RUN_CONFIG, config.resolved_json().encode())
    initial = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    assert versions.commit(run, Version(0, "initial"), initial, None, None)
    return run, Syncer(run, config, None, Reporter(run, 3))


def send(run: ObjectStore, learner: int, seq: int, values: list[float], base: int = 0) -> None:
    c = Contribution(learner, seq, base, tokens=10, steps=4)
    assert versions.publish(run, "hand", c, torch.tensor(values), "fp32", None) > 0


def test_a_merge_is_the_mean_then_the_outer_nesterov_step(tmp_path: Path) -> None:
    run, syncer = run_of(tmp_path)
    syncer._load(0)
    send(run, 0, 0, [1.0, 2.0, 3.0])
    send(run, 1, 0, [3.0, 2.0, 1.0])
    send(run, 2, 0, [2.0, 5.0, -1.0])
    syncer._merge(syncer._gather())
    # mean (2, 3, 1); Nesterov's first step: buf = g, p -= lr * (g + momentum * buf) = lr * 1.25 * g
    params = versions.load_params(run, versions.read_version(run, 1), None)
    assert torch.equal(params["w"], torch.tensor([1.0 - 0.5 * 1.25 * 2, 2.0 - 0.5 * 1.25 * 3]))
    assert torch.equal(params["b"], torch.tensor([0.5 - 0.5 * 1.25 * 1]))
    record = versions.read_version(run, 1)
    assert record.merged == [[0, 0], [1, 0], [2, 0]] and record.consumed == {0: 1, 1: 1, 2: 1}
    # The outer momentum is stored with it: a second merge from a restarted syncer continues it.
    send(run, 0, 1, [1.0, 1.0, 1.0], base=1)
    send(run, 1, 1, [1.0, 1.0, 1.0], base=1)
    send(run, 2, 1, [1.0, 1.0, 1.0], base=1)
    restarted = Syncer(run, syncer.config, None, syncer.reporter)
    restarted._load(1)
    restarted._merge(restarted._gather())
    # buf = 0.25 * (2, 3, 1) + 1; step = lr * (1 + 0.25 * buf)
    after = versions.load_params(run, versions.read_version(run, 2), None)
    expected_w = params["w"] - LR * (1 + MOMENTUM * (MOMENTUM * torch.tensor([2.0, 3.0]) + 1))
    assert torch.allclose(after["w"], expected_w, rtol=0, atol=1e-6)


def test_a_corrupt_or_too_old_contribution_is_dropped_and_recorded_never_merged(tmp_path: Path) -> None:
    run, syncer = run_of(tmp_path, max_age=0)
    syncer._load(0)
    send(run, 0, 0, [1.0, 1.0, 1.0])
    send(run, 1, 0, [3.0, 3.0, 3.0])
    key = layout.contribution(2, 0)
    send(run, 2, 0, [9.0, 9.0, 9.0])
    data = bytearray(run.get(key))
    data[-1] ^= 0xFF
    run.put(key, bytes(data))
    syncer._merge(syncer._gather())
    record = versions.read_version(run, 1)
    assert record.merged == [[0, 0], [1, 0]] and record.consumed == {0: 1, 1: 1, 2: 1}
    assert [(d["learner"], d["seq"]) for d in record.dropped] == [(2, 0)]
    assert "checksum" in record.dropped[0]["why"]
    # A contribution from version 0 merged into version 2 is one version old: dropped (max_age 0).
    send(run, 0, 1, [1.0, 1.0, 1.0], base=1)
    send(run, 1, 1, [1.0, 1.0, 1.0], base=0)
    send(run, 2, 1, [1.0, 1.0, 1.0], base=1)
    syncer._merge(syncer._gather())
    record = versions.read_version(run, 2)
    assert record.merged == [[0, 1], [2, 1]] and [d["learner"] for d in record.dropped] == [1]


def test_a_quorum_and_a_grace_window_merge_without_the_missing_learner(tmp_path: Path) -> None:
    run, syncer = run_of(tmp_path, min_quorum=2, grace_s=0.0)
    syncer._load(0)
    send(run, 0, 0, [1.0, 1.0, 1.0])
    send(run, 2, 0, [3.0, 3.0, 3.0])
    syncer._merge(syncer._gather())
    record = versions.read_version(run, 1)
    assert record.merged == [[0, 0], [2, 0]] and record.consumed == {0: 1, 2: 1}
    # Learner 1's first contribution, late, is merged into the next version with the others' second ones.
    send(run, 1, 0, [2.0, 2.0, 2.0])
    assert versions.waiting(run, 3, record.consumed) == {1: [0]}


def test_two_syncers_cannot_both_commit_a_version(tmp_path: Path) -> None:
    run, first = run_of(tmp_path)
    second = Syncer(run, first.config, None, first.reporter)
    first._load(0)
    second._load(0)
    for learner in range(3):
        send(run, learner, 0, [1.0, 1.0, 1.0])
    taken = first._gather()
    first._merge(taken)
    second._merge(taken)  # loses the creation of version 1: goes on from the first one's
    assert versions.newest_version(run) == 1 and versions.read_version(run, 1).writer == first.writer
    assert second.record == versions.read_version(run, 1)


@pytest.mark.parametrize(
    ("diloco", "said"),
    [
        ({"codec": "sparse"}, "diloco.codec = 'sparse'"),
        ({"fragments": 2, "sync_every": 4}, "diloco.fragments > 1"),
        ({"embedding_average": "touched"}, "set it to 'all'"),
        ({"decoupled": {"min_quorum": 5}}, "cannot exceed diloco.replicas"),
        ({"decoupled": {"max_lag": 2, "max_age": 1}}, "must be at least max_lag"),
        ({"decoupled": {"keep_versions": 0}}, "keep_versions"),
        ({"decoupled": {"outer": "delayed_nesterov"}, "nesterov": False}, "needs nesterov = true"),
    ],
)
def test_decoupled_mode_refuses_what_it_does_not_do(diloco: dict, said: str) -> None:
    raw = {
        "model": {"path": "."},
        "diloco": {
            "replicas": 2,
            "sync_every": 4,
            "rounds": 1,
            "mode": "decoupled",
            "embedding_average": "all",
        }
        | diloco,
    }
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        validate_config(raw)


def test_decoupled_mode_refuses_lora() -> None:
    base = {"replicas": 2, "sync_every": 4, "rounds": 1, "mode": "decoupled", "embedding_average": "all"}
    with pytest.raises(ValueError, match="model.lora"):
        validate_config({"model": {"path": ".", "lora": {}}, "diloco": base})


def test_resuming_a_decoupled_run_is_refused_before_anything_is_written(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = make_config(
        str(tmp_path), "to-resume", tiny_model_dir, mode="decoupled", embedding_average="all"
    )
    run = create(config)
    before = sorted(run.list_tree())
    with pytest.raises(ConfigError, match="resuming a decoupled run"):
        resume(run.url, Console(quiet=True))
    assert sorted(run.list_tree()) == before


def test_token_weights_and_delayed_nesterov_reach_the_merge(tmp_path: Path) -> None:
    """tokens ** 2 / steps: 10 tokens in 4 steps weigh 25, 30 in 4 weigh 225: the merge is 0.1 a + 0.9 b.
    Delayed Nesterov with N = 3 learners: its first step is g / N, the momentum not yet updated."""
    run, syncer = run_of(tmp_path, outer="delayed_nesterov")
    syncer._load(0)
    for learner, tokens, value in ((0, 10, 1.0), (1, 30, 3.0)):
        c = Contribution(learner, 0, 0, tokens=tokens, steps=4)
        versions.publish(run, "hand", c, torch.full((3,), value), "fp32", None)
    send(run, 2, 0, [2.8, 2.8, 2.8])  # 10 tokens: weight 25
    syncer._merge(syncer._gather())
    merged = (25 * 1.0 + 225 * 3.0 + 25 * 2.8) / 275
    after = versions.load_params(run, versions.read_version(run, 1), None)
    assert torch.allclose(after["w"], torch.tensor([1.0, 2.0]) - LR * merged / 3, rtol=0, atol=1e-6)
