"""A decoupled learner sends each inner step's progress exactly once: a learner ``max_lag`` ahead that finds
no newer global after publishing trains on from where it published, and its next contribution holds only the
steps since (it used to hold the published ones again: the global it held minus its local parameters). An
adoption between contributions carries (``keep``) or discards (``overwrite``) only the progress not sent.

The learner runs in this process on the simulated accelerator, with the tiny model, its real inner steps and
its real contributions, read back from the store through the fp32 codec."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.models.loading import load_pretrained
from composer_serverless.objectives import lm as objective
from composer_serverless.rendezvous import decoupled as versions
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.decoupled import Version
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.telemetry import Reporter
from composer_serverless.replicas import arrivals
from composer_serverless.replicas.arrivals import Arrivals
from composer_serverless.replicas.decoupled import DecoupledLearner
from composer_serverless.replicas.diloco import make_schedule
from composer_serverless.replicas.meter import trained_tokens
from tests.rendezvous.harness import create, make_config

H = 2


@pytest.fixture
def learner(
    tmp_path: Path, tiny_model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[DecoupledLearner]:
    """Learner 0 of 2 (``max_lag = 1``, fp32 contributions), started: it holds version 0."""
    config = make_config(
        str(tmp_path / "runs"),
        "progress",
        tiny_model_dir,
        mode="decoupled",
        embedding_average="all",
        codec="fp32",
        sync_every=H,
        decoupled={"max_lag": 1, "adopt": request.param},
    )
    run = create(config)
    with simulated():
        model, tokenizer = load_pretrained(tiny_model_dir, "float32")
        learner = DecoupledLearner(run, config, 0, Reporter(run, 0), model.to("cuda").train(), tokenizer)
        learner._start()
        yield learner


def local_params(learner: DecoupledLearner) -> dict[str, torch.Tensor]:
    return {name: p.detach().to("cpu", copy=True) for name, p in learner.params.items()}


def flat(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in params.values()])


def train_round(learner: DecoupledLearner) -> None:
    learner.meter.reset()
    while learner.meter.steps < H:
        learner._inner_step()


def sent(learner: DecoupledLearner, seq: int) -> torch.Tensor:
    numel = sum(p.numel() for p in learner.params.values())
    run = learner.run_store
    return versions.read_contribution(run, "progress", 0, seq, "fp32", numel, None)[1]


def nan_at_call(monkeypatch: pytest.MonkeyPatch, poisoned: int) -> None:
    """The objective's loss times NaN at its ``poisoned``-th call from now (as in
    tests/replicas/test_divergence.py)."""
    real = objective.LMObjective.losses
    calls = 0

    def diverging(self, model):
        nonlocal calls
        calls += 1
        for loss, metrics in real(self, model):
            yield (loss * float("nan") if calls == poisoned else loss), metrics

    monkeypatch.setattr(objective.LMObjective, "losses", diverging)


@pytest.mark.parametrize("learner", ["keep", "overwrite"], indirect=True)
def test_two_contributions_without_a_newer_global_send_each_step_once(
    learner: DecoupledLearner, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = local_params(learner)
    train_round(learner)
    published = local_params(learner)
    learner._publish()
    # No newer version: it trains on from where it published. Its first step there is discarded (a NaN
    # loss): it goes back to the point it published, not to the global it holds.
    nan_at_call(monkeypatch, 1)
    learner.meter.reset()
    learner._inner_step()
    assert learner.nonfinite == 1 and learner.meter.steps == 0
    assert all(torch.equal(published[n], t) for n, t in local_params(learner).items())
    train_round(learner)
    final = local_params(learner)
    learner._publish()

    first, second = sent(learner, 0), sent(learner, 1)
    assert torch.equal(first, flat(start) - flat(published))
    assert torch.equal(second, flat(published) - flat(final))  # the steps since the first only
    assert bool((second != 0).any()) and bool((first != second).any())  # both rounds trained
    # Together they are all the learner's progress since the global it started from (to fp32 rounding of
    # the two differences), once; before the fix the first round's progress came twice.
    torch.testing.assert_close(first + second, flat(start) - flat(final), rtol=0, atol=1e-6)
    # It still holds version 0: that is what it scores and exports, and its contributions' base.
    assert learner.version == 0 and all(torch.equal(learner.base[n], start[n]) for n in start)
    assert (
        versions.read_contribution(learner.run_store, "progress", 0, 1, "fp32", first.numel(), None)[0].base
        == 0
    )


@pytest.mark.parametrize("learner", ["keep", "overwrite"], indirect=True)
def test_an_adoption_between_contributions_carries_only_the_unsent_progress(
    learner: DecoupledLearner,
) -> None:
    """Adopting version 1 (hand-made: version 0 plus 0.01) two inner steps after publishing: with ``keep``
    the learner holds version 1 plus those two steps and sends them with its next contribution; with
    ``overwrite`` it holds version 1 and they are never sent. The published steps are not sent again."""
    train_round(learner)
    published = local_params(learner)
    learner._publish()
    train_round(learner)
    before = local_params(learner)
    run = learner.run_store
    g1 = {name: t + 0.01 for name, t in learner.base.items()}
    record = Version(1, "hand-made", consumed={0: 1}, merged=[[0, 0]])
    assert versions.commit(run, record, g1, None, None)
    record = versions.read_version(run, 1)
    learner._adopt(record, versions.load_params(run, record, None))

    adopted = local_params(learner)
    keep = learner.config.diloco.decoupled.adopt == "keep"
    for name in g1:
        expected = g1[name] + (before[name] - published[name]) if keep else g1[name]
        assert torch.equal(adopted[name], expected), name
    assert learner.version == 1 and all(torch.equal(learner.base[n], g1[n]) for n in g1)

    train_round(learner)
    final = local_params(learner)
    learner._publish()
    second = sent(learner, 1)
    assert torch.equal(second, flat(g1) - flat(final))
    unsent = flat(published) - flat(before)  # the two steps after the first contribution
    since = flat(adopted) - flat(final)  # the round after the adoption
    torch.testing.assert_close(second, (unsent if keep else 0) + since, rtol=0, atol=1e-6)
    assert versions.read_contribution(run, "progress", 0, 1, "fp32", second.numel(), None)[0].base == 1


def adopted_from_the_reader(learner: DecoupledLearner, reader: Arrivals, at_step: int) -> None:
    """Look at every step boundary, as the learner's loop does, until its reader has read the newer version
    (bounded: a reader that never delivers fails the test)."""
    for _ in range(3000):
        learner._adopt_arrived(reader, at_step)
        if learner.version > 0:
            return
        time.sleep(0.01)
    raise AssertionError("the reader never handed over version 1")


@pytest.mark.parametrize("learner", ["keep", "overwrite"], indirect=True)
def test_a_mid_round_adoption_keeps_or_discards_the_steps_since_publishing(learner: DecoupledLearner) -> None:
    """Version 1 (hand-made: version 0 plus 0.01) arrives after the round's first inner step, read by the
    learner's background reader: with ``keep`` the learner holds version 1 plus that step, and its next
    contribution sends both steps, counted; with ``overwrite`` it holds version 1 and its contribution sends
    and counts the second step only. Its row of version 1 says at which step it adopted and what it dropped."""
    start = local_params(learner)
    run = learner.run_store
    learner.meter.reset()
    learner._inner_step()
    after_one = local_params(learner)
    g1 = {name: t + 0.01 for name, t in learner.base.items()}
    assert versions.commit(run, Version(1, "hand-made"), g1, None, None)
    with Arrivals(run, None, learner.version, poll_s=0.01) as reader:
        adopted_from_the_reader(learner, reader, at_step=1)
    keep = learner.config.diloco.decoupled.adopt == "keep"
    adopted = local_params(learner)
    for name in g1:
        expected = g1[name] + (after_one[name] - start[name]) if keep else g1[name]
        assert torch.equal(adopted[name], expected), name
    assert learner.discarded == (0 if keep else 1)
    row = json.loads(run.get(layout.metrics(0, 1)))
    assert (row["version"], row["adopted_at_step"], row["overwritten_steps"]) == (1, 1, 0 if keep else 1)

    learner._inner_step()  # the round's second (last) step
    final = local_params(learner)
    step_tokens = [int(trained_tokens(m)) for m in learner.meter.metrics]
    learner._publish()
    header, values = versions.read_contribution(run, "progress", 0, 0, "fp32", flat(g1).numel(), None)
    assert torch.equal(values, flat(g1) - flat(final))
    assert header.base == 1
    assert (header.steps, header.tokens) == ((2, sum(step_tokens)) if keep else (1, step_tokens[1]))
    assert learner.sent[-1]["discarded_steps"] == (0 if keep else 1)
    if keep:  # both steps' progress, each once: the first carried onto version 1, the second since
        torch.testing.assert_close(
            values, (flat(start) - flat(after_one)) + (flat(adopted) - flat(final)), rtol=0, atol=1e-6
        )


def test_the_reader_raises_its_failure_in_the_learner_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of the background reader (here its store listing) is raised by the learner's next look,
    never lost; the reader's thread has stopped and is gone once closed."""

    def broken(store):
        raise OSError("the store went away")

    monkeypatch.setattr(arrivals, "newest_version", broken)
    reader = Arrivals(ObjectStore(str(tmp_path)), None, 0, poll_s=0.01)
    with pytest.raises(OSError, match="the store went away"), reader:
        for _ in range(3000):
            reader.take(0)
            time.sleep(0.01)
    assert not reader._thread.is_alive()


def test_the_reader_passes_over_a_damaged_version_for_the_next(tmp_path: Path) -> None:
    """A version whose snapshot does not read whole is passed over (as the learner's own reading does); the
    next version the syncer commits is handed over."""
    run = ObjectStore(str(tmp_path))
    weights = {"w": torch.tensor([1.0, 2.0])}
    assert versions.commit(run, Version(0, "a"), weights, None, None)
    assert versions.commit(run, Version(1, "b"), {"w": torch.tensor([3.0, 4.0])}, None, None)
    damaged = next(
        k for k in run.list_tree(layout.GLOBALS) if k.startswith("00000001-") and "manifest" not in k
    )
    run.put(f"{layout.GLOBALS}/{damaged}", b"not what the manifest says")
    with Arrivals(run, None, 0, poll_s=0.01) as reader:
        for _ in range(200):  # it tries version 1 and passes it over: nothing to hand over
            assert reader.take(0) is None
            time.sleep(0.01)
        assert versions.commit(run, Version(2, "c"), {"w": torch.tensor([5.0, 6.0])}, None, None)
        for _ in range(3000):
            got = reader.take(0)
            if got is not None:
                break
            time.sleep(0.01)
    assert got is not None and got[0].version == 2 and torch.equal(got[1]["w"], torch.tensor([5.0, 6.0]))


@pytest.mark.parametrize("learner", ["keep"], indirect=True)
def test_the_schedule_follows_the_global_it_adopts(learner: DecoupledLearner) -> None:
    """``rounds`` counts versions: a learner that adopts version 3 after one round of its own is placed at
    3 x H inner steps of the schedule, where a learner starting at version 3 is (with a quorum below N it
    trains fewer rounds than there are versions, and its cosine would otherwise end part-way); one whose own
    steps are ahead of the version it adopts goes back to its place (its rounds counted from the merges run
    longer than H, and its cosine would otherwise end versions before the run)."""
    train_round(learner)
    learner._publish()
    assert learner.schedule.last_epoch == H
    run = learner.run_store
    for v in (3, 4):
        g = {name: t + 0.01 * v for name, t in learner.base.items()}
        assert versions.commit(run, Version(v, "hand-made", consumed={0: 1}, merged=[[0, 0]]), g, None, None)
    record = versions.read_version(run, 3)
    learner._adopt(record, versions.load_params(run, record, None))
    train = learner.config.train
    at = make_schedule(torch.optim.SGD([torch.zeros(1)], lr=train.lr), train, learner.total_steps, 3 * H)
    assert learner.schedule.last_epoch == 3 * H
    assert {group["lr"] for group in learner.inner.param_groups} == {at.get_last_lr()[0]}
    for _ in range(3):  # its own steps now run ahead of version 4's place
        train_round(learner)
    learner._publish()
    assert learner.schedule.last_epoch == 6 * H
    record = versions.read_version(run, 4)
    learner._adopt(record, versions.load_params(run, record, None))
    assert learner.schedule.last_epoch == 4 * H


def adopt_version(
    learner: DecoupledLearner,
    v: int,
    consumed: int,
    at_step: int,
    held_s: float | None = None,
    step_s: dict[int, float] | None = None,
) -> None:
    """Adopt hand-made version ``v`` (version 0 plus 0.01 v), whose merges consumed learner 0's contributions
    before ``consumed``, at inner step ``at_step``; ``held_s``: how long the syncer held its contribution
    waiting for the merge's last one; ``step_s``: the merged learners' seconds per inner step."""
    run = learner.run_store
    g = {name: t + 0.01 * v for name, t in learner.base.items()}
    held = {} if held_s is None else {0: held_s, 1: 0.0}
    record = Version(v, "hand-made", {0: consumed}, [[0, consumed - 1]], held_s=held, step_s=step_s or {})
    assert versions.commit(run, record, g, None, None)
    record = versions.read_version(run, v)
    learner._adopt(record, versions.load_params(run, record, None), at_step)


@pytest.mark.parametrize("learner", ["keep"], indirect=True)
@pytest.mark.parametrize("align", [True, False])
def test_a_learner_ahead_of_the_others_lengthens_its_round_by_the_time_it_was_held(
    learner: DecoupledLearner, align: bool
) -> None:
    """Its steps take 0.5 s (the header's seconds per step, set here for round numbers); version 1 merged its
    contribution 0 after holding it 0.6 s for the last learner's: with ``align`` the round in progress runs
    round(0.6 / 0.5) = 1 step more (H + 1), once per contribution: a later version that merged it too changes
    nothing, nor does one that merged only an older contribution, and a hold of under half a step (it came
    about last) leaves the round at H. A hold of more than a round lengthens it by H - 1 at most (a minute's
    hold: H + 1 here, not 120 steps more). Without ``align`` every round is H steps."""
    dl = learner.config.diloco
    decoupled = dl.decoupled.model_copy(update={"align": align})
    learner.config = learner.config.model_copy(
        update={"diloco": dl.model_copy(update={"decoupled": decoupled})}
    )
    lengthened = H + 1 if align else H
    train_round(learner)
    learner._publish()  # contribution 0
    learner.step_s = 0.5
    learner.meter.reset()
    learner._inner_step()
    adopt_version(learner, 1, consumed=1, at_step=1, held_s=0.6)
    assert learner.round_steps == lengthened
    adopt_version(learner, 2, consumed=1, at_step=1, held_s=2.0)  # merged it too: already counted
    assert learner.round_steps == lengthened
    while learner.meter.steps < learner.round_steps:
        learner._inner_step()
    learner._publish()  # contribution 1, the steps of the longer round
    assert learner.sent[-1]["steps"] == lengthened
    assert learner.round_steps == H  # the next round's, until an adoption lengthens it
    learner.step_s = 0.5
    learner.meter.reset()
    learner._inner_step()
    adopt_version(learner, 3, consumed=1, at_step=1, held_s=2.0)  # contribution 1 is not merged yet
    assert learner.round_steps == H
    adopt_version(learner, 4, consumed=2, at_step=1, held_s=0.2)  # about last: its pace is the others'
    assert learner.round_steps == H
    while learner.meter.steps < learner.round_steps:
        learner._inner_step()
    learner._publish()  # contribution 2
    learner.step_s = 0.5
    adopt_version(learner, 5, consumed=3, at_step=1, held_s=60.0)
    assert learner.round_steps == (2 * H - 1 if align else H)


@pytest.mark.parametrize("learner", ["keep"], indirect=True)
@pytest.mark.parametrize(("dynamic_steps", "max_lag"), [(True, 1), (False, 1), (True, 0)])
def test_a_slower_learner_paces_its_rounds_by_the_fastest_step_time(
    learner: DecoupledLearner, dynamic_steps: bool, max_lag: int
) -> None:
    """H = 10 here; this learner's steps take 0.5 s (the header's seconds per step, set for round numbers).
    With ``dynamic_steps`` each version it adopts sets its rounds to round(10 x fastest / 0.5) steps, the
    fastest among the version's merged learners and itself: 4 beside a learner at 0.2 s (the round in
    progress, one step in, becomes 4 steps long), 9 beside one at 0.45 s, 1 at least beside one 50 times
    faster (but the round in progress, adopted at step 1, keeps one step after it: 2), and 10 when it is the
    fastest. The next round after a publish has its pace; a hold it makes up
    (``align``) lengthens that pace, by less than it. Off, or with ``max_lag = 0`` (lock-step's schedule),
    every round is H."""
    dl = learner.config.diloco
    decoupled = dl.decoupled.model_copy(update={"dynamic_steps": dynamic_steps, "max_lag": max_lag})
    learner.config = learner.config.model_copy(
        update={"diloco": dl.model_copy(update={"sync_every": 10, "decoupled": decoupled})}
    )
    paced = dynamic_steps and max_lag > 0

    def adopt(v: int, fastest: float, consumed: int = 1, held_s: float | None = None) -> int:
        learner.step_s = 0.5
        adopt_version(learner, v, consumed, at_step=1, held_s=held_s, step_s={0: 0.5, 1: fastest})
        return learner.round_steps

    train_round(learner)
    learner._publish()  # contribution 0
    learner.meter.reset()
    learner._inner_step()
    learner.pace = 10  # the fixture's H is 2
    assert adopt(1, fastest=0.2) == (4 if paced else 10)
    assert adopt(2, fastest=0.45) == (9 if paced else 10)
    assert adopt(3, fastest=0.01) == (2 if paced else 10)
    assert learner.pace == (1 if paced else 10)
    assert adopt(4, fastest=0.9) == 10
    assert adopt(5, fastest=0.2) == (4 if paced else 10)
    while learner.meter.steps < learner.round_steps:
        learner._inner_step()
    learner._publish()  # contribution 1
    assert learner.sent[-1]["steps"] == (4 if paced else 10)
    assert learner.round_steps == (4 if paced else 10)  # the next round's: its pace
    # contribution 1 merged after a hold of 1 s = 2 steps: its pace plus 2 (align, on by default)
    assert adopt(6, fastest=0.2, consumed=2, held_s=1.0) == (4 + 2 if paced else 10 if max_lag == 0 else 12)
