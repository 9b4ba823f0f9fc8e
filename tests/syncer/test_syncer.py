"""The syncer in this process, on hand-made contributions: its arithmetic on hand-computed numbers, what it
drops and records, and its commit against a second syncer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from composer_serverless.config import RunConfig, validate_config
from composer_serverless.config.decoupled import DecoupledConfig
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.decoupled import Contribution, Plan, Version
from composer_serverless.rendezvous.latest import newest_version
from composer_serverless.rendezvous.rows import RowBlock
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.syncer.syncer import Syncer
from tests.rendezvous.harness import make_config

LR, MOMENTUM = 0.5, 0.25


def hand_config(tmp_path: Path, store: str, decoupled: dict[str, object], **diloco: object) -> RunConfig:
    """Run "hand" of 3 learners, 2 versions, the outer step of ``LR`` and ``MOMENTUM``, no outlier rule; with
    ``diloco`` and ``decoupled`` settings over those."""
    settings: dict[str, object] = {
        "replicas": 3,
        "rounds": 2,
        "mode": "decoupled",
        "embedding_average": "all",
        "outer_lr": LR,
        "outer_momentum": MOMENTUM,
        "outlier_norm_factor": None,
        **diloco,
        "decoupled": {"poll_s": 0.01, **decoupled},
    }
    return make_config(store, "hand", tmp_path, **settings)


def run_of(tmp_path: Path, store: str | None = None, **decoupled: object) -> tuple[ObjectStore, Syncer]:
    """A run of 3 learners in ``store`` (``tmp_path`` unless given) holding version 0, and its syncer."""
    store = store or str(tmp_path)
    config = hand_config(tmp_path, store, decoupled)
    run = ObjectStore(store).child("hand")
    run.put(layout.RUN_CONFIG, config.resolved_json().encode())
    initial = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    assert versions.commit(run, Version(0, "initial"), initial, None, None)
    return run, Syncer(run, config, None, Reporter(run, 3))


def send(
    run: ObjectStore,
    learner: int,
    seq: int,
    values: list[float],
    base: int = 0,
    seconds: float | None = None,
    steps: int = 4,
) -> None:
    c = Contribution(learner, seq, base, tokens=10, steps=steps, seconds=seconds)
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
    assert newest_version(run) == 1 and versions.read_version(run, 1).writer == first.writer
    assert second.record == versions.read_version(run, 1)


def test_touched_rows_are_combined_over_the_contributions_that_held_them(tmp_path: Path) -> None:
    """embedding_average = "touched", H = 1 (one step bucket): a 3-token embedding ``emb`` (width 1) and a
    bias. Learner 0's data held token 0, learner 1's tokens 0 and 1, learner 2's none. Plain mean of emb
    (3, 0, 0), (3, 6, 0), (0, 0, 9): (2, 2, 3); row 0 over learners 0 and 1: (3 + 3) * 1 bucket / 2 = 3;
    row 1 learner 1's alone: 6; row 2, held by none, the plain mean 3. Then Nesterov's first step,
    lr * 1.25 * g."""
    decoupled = {"min_quorum": 1, "grace_s": 0}
    config = hand_config(
        tmp_path, str(tmp_path), decoupled, rounds=1, sync_every=1, embedding_average="touched"
    )
    run = ObjectStore(str(tmp_path)).child("hand")
    run.put(layout.RUN_CONFIG, config.resolved_json().encode())
    initial = {"emb": torch.ones(3, 1), "b": torch.tensor([0.5])}
    assert versions.commit(run, Version(0, "initial", token_rows=["emb"]), initial, None, None)
    assert versions.row_blocks({"emb": (3, 1), "b": (1,)}, ["emb"]) == (RowBlock(offset=0, rows=3, width=1),)
    held = {0: [True, False, False], 1: [True, True, False], 2: [False, False, False]}
    values = {0: [3.0, 0.0, 0.0, 3.0], 1: [3.0, 6.0, 0.0, 0.0], 2: [0.0, 0.0, 9.0, 0.0]}
    for learner in range(3):
        c = Contribution(learner, 0, 0, tokens=10, steps=1, touched=torch.tensor(held[learner]))
        assert versions.publish(run, "hand", c, torch.tensor(values[learner]), "fp32", None) > 0
    syncer = Syncer(run, config, None, Reporter(run, 3))
    syncer._load(0)
    syncer._merge(syncer._gather())
    record = versions.read_version(run, 1)
    assert record.merged == [[0, 0], [1, 0], [2, 0]] and record.token_rows == ["emb"]
    params = versions.load_params(run, record, None)
    assert torch.equal(params["emb"], 1 - 0.625 * torch.tensor([[3.0], [6.0], [3.0]]))
    assert torch.equal(params["b"], torch.tensor([0.5 - 0.625 * 1.0]))
    # A contribution without the row bits a touched run's contributions carry is dropped, saying why.
    send(run, 0, 1, [1.0, 1.0, 1.0, 1.0], base=1)
    syncer._merge(syncer._gather())
    assert "'rows': (None, '3')" in versions.read_version(run, 2).dropped[0]["why"]


@pytest.mark.parametrize(
    ("diloco", "said"),
    [
        ({"codec": "sparse"}, "diloco.codec = 'sparse'"),
        ({"fragments": 2, "sync_every": 4}, "diloco.fragments > 1"),
        ({"decoupled": {"min_quorum": 5}}, "cannot exceed diloco.replicas"),
        ({"decoupled": {"max_lag": 2, "max_age": 1}}, "must be at least max_lag"),
        ({"decoupled": {"keep_versions": 0}}, "keep_versions"),
        ({"decoupled": {"grace_gamma": 1.0}}, "grace_gamma"),
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


def test_decoupled_mode_takes_lora_and_the_composer_objective_but_refuses_a_live_harvest() -> None:
    from tests.harvest.test_config_harvest import RUN

    decoupled = {"mode": "decoupled", "embedding_average": "all"}
    lora = {"model": {"path": ".", "lora": {}}, "diloco": {"sync_every": 4, "rounds": 1, **decoupled}}
    assert validate_config(lora).model.lora is not None
    live = {**RUN, "diloco": {**RUN["diloco"], **decoupled}}
    with pytest.raises(ValueError, match=r"a live harvest \(harvest.live;"):
        validate_config(live)
    recorded = {**live, "harvest": {**RUN["harvest"], "live": False}}
    recorded["composer"] = {**RUN["composer"], "beta": 0.0, "record_rollouts": True}
    assert validate_config(recorded).train.objective == "composer"


def test_a_restarted_syncer_rolls_back_past_a_damaged_version_and_merges_what_it_took_again(
    tmp_path: Path,
) -> None:
    """Version 2 damaged after its commit (its parameters fail their checksum): a restarted syncer continues
    from version 1's global, outer momentum and marks, so version 3 merges the contributions version 2 took
    (seq 1) with the new ones (seq 2), steps from version 1's global, and names version 1 its parent."""
    run, syncer = run_of(tmp_path)
    syncer._load(0)
    for learner, values in enumerate(([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [2.0, 5.0, -1.0])):
        send(run, learner, 0, values)
    syncer._merge(syncer._gather())  # version 1: mean (2, 3, 1)
    for learner in range(3):
        send(run, learner, 1, [1.0, 1.0, 1.0], base=1)
    syncer._merge(syncer._gather())  # version 2
    damaged = f"{layout.global_params(2, syncer.writer)}/{layout.SNAPSHOT_TENSORS}"
    data = bytearray(run.get(damaged))
    data[-1] ^= 0xFF
    run.put(damaged, bytes(data))
    # A learner starting now holds version 1, the newest that reads whole.
    assert versions.newest_intact(run, 2, None, outer=False)[0].version == 1

    restarted = Syncer(run, syncer.config, None, syncer.reporter)
    restarted._load(newest_version(run))
    assert restarted.newest == 2 and restarted.record.version == 1
    for learner in range(3):
        send(run, learner, 2, [3.0, 3.0, 3.0], base=1)
    restarted._merge(restarted._gather())
    record = versions.read_version(run, 3)
    assert record.parent == 1 and versions.read_version(run, 2).parent == 1
    assert record.merged == [[learner, seq] for learner in range(3) for seq in (1, 2)]
    assert record.consumed == {0: 3, 1: 3, 2: 3} and record.dropped == []
    # Version 1: p1 = p0 - lr * 1.25 * (2, 3, 1), momentum (2, 3, 1). Version 3 from it with the mean (2, 2, 2):
    # buf = 0.25 * (2, 3, 1) + 2, p3 = p1 - lr * (2 + 0.25 * buf).
    after = versions.load_params(run, record, None)
    assert torch.allclose(after["w"], torch.tensor([-1.5625, -1.21875]), rtol=0, atol=1e-6)
    assert torch.allclose(after["b"], torch.tensor([-1.40625]), rtol=0, atol=1e-6)


def test_token_weights_and_delayed_nesterov_reach_the_merge(tmp_path: Path) -> None:
    """tokens ** 2 / steps: 10 tokens in 4 steps weigh 25, 30 in 4 weigh 225: the merge is 0.1 a + 0.9 b.
    Delayed Nesterov with N = 3 learners counts contributions: a merge of all three is a whole block, so its
    first step is Nesterov's, lr * (1 + momentum) * g (a merge of one would step g / N: test_outer.py)."""
    run, syncer = run_of(tmp_path, outer="delayed_nesterov")
    syncer._load(0)
    for learner, tokens, value in ((0, 10, 1.0), (1, 30, 3.0)):
        c = Contribution(learner, 0, 0, tokens=tokens, steps=4)
        versions.publish(run, "hand", c, torch.full((3,), value), "fp32", None)
    send(run, 2, 0, [2.8, 2.8, 2.8])  # 10 tokens: weight 25
    syncer._merge(syncer._gather())
    merged = (25 * 1.0 + 225 * 3.0 + 25 * 2.8) / 275
    after = versions.load_params(run, versions.read_version(run, 1), None)
    expected = torch.tensor([1.0, 2.0]) - LR * (1 + MOMENTUM) * merged
    assert torch.allclose(after["w"], expected, rtol=0, atol=1e-6)


class FakeTime:
    """The syncer's clock and sleep, driven by the test: time passes only in ``sleep`` (and ``advance``), and
    each event scheduled with ``at`` runs once the time reaches it, as a contribution arriving meanwhile."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[tuple[float, Callable[[], None]]] = []

    def at(self, when: float, event: Callable[[], None]) -> None:
        self.events.append((when, event))

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        due = [e for e in self.events if e[0] <= self.now]
        self.events = [e for e in self.events if e[0] > self.now]
        for _, event in sorted(due, key=lambda e: e[0]):
            event()

    def advance(self, seconds: float) -> None:
        self.now += seconds


def timed_syncer(tmp_path: Path, **decoupled: object) -> tuple[ObjectStore, Syncer, FakeTime]:
    """``run_of``'s run and a syncer on a ``FakeTime`` polling every 0.5 s, holding version 0."""
    run, syncer = run_of(tmp_path, poll_s=0.5, **decoupled)
    time = FakeTime()
    syncer = Syncer(run, syncer.config, None, syncer.reporter, clock=time.clock, sleep=time.sleep)
    syncer._load(0)
    return run, syncer, time


def test_the_adaptive_grace_waits_gamma_times_the_slack_the_overlap_hides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tau = sync_every = 4 (max_lag 1), gamma 0.5, no grace_s bound. t_quorum runs from the first
    contribution in hand, whose learner has trained on since, not from when the syncer began waiting.
    Version 1: learners 0 (8 s for 4 steps) and 2 (12 s) arrive at 1 s and 2 s, after a second of waiting
    for nothing: the quorum took 1 s, no merge yet (t_sync 0), the median step 2.5 s:
    grace = 0.5 * (4 * 2.5 - 1) = 4.5 s, so it merges at 6.5 s without learner 1, who comes at 7 s, during
    the merge, whose commit takes 1.5 s on the syncer's clock. Version 2: the wait begins at 8 s; learner 1's
    (16 s) is first seen at the poll of 8.5 s and learner 0's second (8 s) makes the quorum at 9 s, 0.5 s
    later: grace = 0.5 * (4 * median(4, 2) - 0.5 - 1.5) = 5 s, and learner 2's second, at 12 s, is in time:
    every learner's is in, it merges at once. Each record says how long the syncer held each learner's
    contribution waiting for the last one it took (``held_s``, which the learners that came early make up),
    and the seconds per inner step of each learner's newest contribution it took (``step_s``, by which the
    slower ones pace their rounds).
    """
    run, syncer, time = timed_syncer(tmp_path, min_quorum=2, max_lag=1, grace_gamma=0.5)
    commit = versions.commit

    def slow_commit(*args: object, **kwargs: object) -> bool:
        time.advance(1.5)
        return commit(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(versions, "commit", slow_commit)
    time.at(1.0, lambda: send(run, 0, 0, [1.0, 1.0, 1.0], seconds=8.0))
    time.at(2.0, lambda: send(run, 2, 0, [3.0, 3.0, 3.0], seconds=12.0))
    time.at(7.0, lambda: send(run, 1, 0, [2.0, 2.0, 2.0], seconds=16.0))
    time.at(9.0, lambda: send(run, 0, 1, [1.0, 1.0, 1.0], base=1, seconds=8.0))
    time.at(12.0, lambda: send(run, 2, 1, [1.0, 1.0, 1.0], base=1, seconds=8.0))

    gathered = syncer._gather()
    assert (time.now, gathered.grace_s, gathered.taken) == (6.5, 4.5, {0: [0], 2: [0]})
    syncer._merge(gathered)
    assert (time.now, syncer.sync_s) == (8.0, 1.5)
    first = versions.read_version(run, 1)
    assert (first.grace_s, first.merged) == (4.5, [[0, 0], [2, 0]])
    # how long each learner's contribution waited for the last one taken: learner 0's 1 s ahead of 2's
    assert first.held_s == {0: 1.0, 2: 0.0}
    assert first.step_s == {0: 2.0, 2: 3.0}  # 8 s and 12 s for 4 steps

    gathered = syncer._gather()
    assert (time.now, gathered.grace_s) == (12.0, 5.0)
    syncer._merge(gathered)
    second = versions.read_version(run, 2)
    assert (second.grace_s, second.merged) == (5.0, [[0, 1], [1, 0], [2, 1]])
    assert second.held_s == {0: 3.0, 1: 3.5, 2: 0.0}  # seen at 9 s, 8.5 s and 12 s
    assert second.step_s == {0: 2.0, 1: 4.0, 2: 2.0}  # learner 2's second took 8 s


@pytest.mark.parametrize(
    ("settings", "seconds", "merged_at", "grace"),
    [
        # grace_gamma unset: today's fixed window, grace_s after the quorum (at 2 s)
        ({"grace_gamma": None, "grace_s": 3.0, "max_lag": 1}, 8.0, 5.0, 3.0),
        # the adaptive window 0.5 * (4 * 2 - 1) = 3.5 s (the quorum 1 s after the first), bounded by grace_s
        ({"grace_s": 1.0, "max_lag": 1}, 8.0, 3.0, 1.0),
        # max_lag 0: the learners wait for this merge, nothing is hidden (tau = 0): no wait at all
        ({"max_lag": 0}, 8.0, 2.0, 0.0),
        # headers without a step time (older learners): the fixed rule, grace_s
        ({"grace_s": 2.5, "max_lag": 1}, None, 4.5, 2.5),
    ],
)
def test_the_grace_rule_for_each_setting(
    tmp_path: Path, settings: dict, seconds: float | None, merged_at: float, grace: float
) -> None:
    run, syncer, time = timed_syncer(tmp_path, min_quorum=2, **settings)
    time.at(1.0, lambda: send(run, 0, 0, [1.0, 1.0, 1.0], seconds=seconds))
    time.at(2.0, lambda: send(run, 2, 0, [3.0, 3.0, 3.0], seconds=seconds))
    time.at(9.0, lambda: send(run, 1, 0, [2.0, 2.0, 2.0], seconds=seconds))
    gathered = syncer._gather()
    assert (time.now, gathered.grace_s, gathered.taken) == (merged_at, grace, {0: [0], 2: [0]})


def test_grace_unset_and_no_gamma_waits_for_every_learner_and_records_no_window(tmp_path: Path) -> None:
    run, syncer, time = timed_syncer(tmp_path, min_quorum=2, grace_gamma=None, grace_s=None)
    time.at(1.0, lambda: send(run, 0, 0, [1.0, 1.0, 1.0], seconds=8.0))
    time.at(2.0, lambda: send(run, 2, 0, [3.0, 3.0, 3.0], seconds=8.0))
    time.at(30.0, lambda: send(run, 1, 0, [2.0, 2.0, 2.0], seconds=8.0))
    gathered = syncer._gather()
    assert (time.now, gathered.grace_s, sorted(gathered.taken)) == (30.0, None, [0, 1, 2])


def test_a_contribution_says_its_seconds_and_old_headers_and_records_still_read(tmp_path: Path) -> None:
    run, _ = run_of(tmp_path)
    send(run, 0, 0, [1.0, 1.0, 1.0], seconds=6.0, steps=3)
    send(run, 1, 0, [1.0, 1.0, 1.0])  # as a learner before the field wrote it: no seconds in the header
    read = [versions.read_contribution(run, "hand", learner, 0, "fp32", 3, None)[0] for learner in (0, 1)]
    assert [(c.seconds, c.step_s) for c in read] == [(6.0, 2.0), (None, None)]
    assert Contribution(0, 0, 0, tokens=1, steps=2, seconds=float("nan")).step_s is None
    record = Version(
        3, "w", {0: 2}, [[0, 1]], parent=2, grace_s=1.25, held_s={0: 0.5, 1: 0.0}, step_s={0: 0.25}
    )
    assert Version.from_json(record.to_json()) == record
    fields = ("grace_s", "held_s", "step_s")
    old = {k: v for k, v in json.loads(record.to_json()).items() if k not in fields}
    before = Version.from_json(json.dumps(old).encode())  # a record of a syncer before the fields
    assert (before.grace_s, before.held_s, before.step_s) == (None, {}, {})
    plan = Plan(3, 2, {0: [1, 2]}, 1.25, {0: 1.5}, {0: 0.25, 1: 0.5})
    assert Plan.from_json(plan.to_json()) == plan


def test_polls_come_a_hundredth_of_a_round_apart_unless_poll_s_is_set(tmp_path: Path) -> None:
    """Unset, ``poll_s`` is a hundredth of a round (``sync_every`` x seconds per step) within [0.05, 5] s, and
    0.5 s before a step time is known; set, it is what it says. The syncer takes the median step time of the
    contributions its newest version merged: 0.5 s at version 0, then 0.01 x 4 steps x median(2, 3, 4) s."""
    unset, fixed = DecoupledConfig(), DecoupledConfig(poll_s=0.3)
    assert unset.poll_every(30, None) == 0.5
    assert unset.poll_every(30, 0.125) == 0.05  # 0.0375 s, at least 0.05
    assert unset.poll_every(100, 2.0) == pytest.approx(2.0)
    assert unset.poll_every(500, 5.0) == 5.0  # 25 s, at most 5
    assert fixed.poll_every(30, None) == fixed.poll_every(100, 2.0) == 0.3
    run, syncer = run_of(tmp_path, poll_s=None)
    syncer._load(0)
    assert syncer._poll_s() == 0.5
    send(run, 0, 0, [1.0, 1.0, 1.0], seconds=8.0)
    send(run, 1, 0, [1.0, 1.0, 1.0], seconds=12.0)
    send(run, 2, 0, [1.0, 1.0, 1.0], seconds=16.0)
    syncer._merge(syncer._gather())
    assert syncer._poll_s() == pytest.approx(0.01 * 4 * 3.0)
