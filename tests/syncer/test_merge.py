"""The syncer's merge arithmetic (syncer/merge.py): weights, staleness, the two averages, the grace window."""

from __future__ import annotations

import math
import queue
import threading
import time
import uuid

import pytest
import torch

from composer_serverless.rendezvous.allreduce import allreduce
from composer_serverless.rendezvous.exchange import ExchangeResult, ExchangeSettings
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.syncer.merge import (
    DEFAULT_MAX_AGE,
    base_weight,
    contribution_weight,
    grace_window,
    merge,
    merge_tensors,
    staleness_factor,
)


def test_token_weights_are_quantity_times_quality() -> None:
    # 1000 tokens in 10 steps: 1000 * 100; the same tokens in 40 smaller steps count a quarter of that.
    assert base_weight(1000, 10, "tokens") == 100_000.0
    assert base_weight(1000, 40, "tokens") == 25_000.0
    assert base_weight(1000, 40, "equal") == 1.0
    with pytest.raises(ValueError, match="tokens > 0 and steps > 0"):
        base_weight(0, 10, "tokens")
    with pytest.raises(ValueError, match="'tokens' or 'equal'"):
        base_weight(10, 1, "bytes")  # type: ignore[arg-type]


def test_staleness_drops_beyond_the_bound_and_discounts_within_it() -> None:
    assert staleness_factor(0, max_age=2, discount=0.0) == 1.0
    assert staleness_factor(2, max_age=2, discount=0.0) == 1.0
    assert staleness_factor(3, max_age=2, discount=0.0) is None
    assert staleness_factor(3, max_age=None, discount=0.5) == 0.4  # 1 / (1 + 0.5 * 3)
    assert staleness_factor(-1, max_age=None, discount=0.0) is None  # a base ahead of the syncer's
    with pytest.raises(ValueError, match="discount"):
        staleness_factor(0, max_age=None, discount=-0.1)
    with pytest.raises(ValueError, match="max_age"):
        staleness_factor(0, max_age=-1, discount=0.0)


def test_the_default_keeps_age_up_to_the_bound_undiscounted() -> None:
    assert contribution_weight(tokens=100, steps=4, age=DEFAULT_MAX_AGE, weighting="tokens") == 2500.0
    assert contribution_weight(tokens=100, steps=4, age=DEFAULT_MAX_AGE + 1, weighting="tokens") is None
    assert contribution_weight(tokens=100, steps=4, age=1, weighting="equal", discount=1.0) == 0.5


def _lock_step_average(values: list[torch.Tensor]) -> torch.Tensor:
    """What lock-step DiLoCo's exchange ends with for these pseudo-gradients: the real ``allreduce`` of
    ``len(values)`` replicas over an in-memory store, fp32 on the wire, all of them in the quorum."""
    n = len(values)
    # Generous bounds, all under pytest's 600 s so a failure names the rank: under a loaded suite on two
    # cores a thread may start late (a CI run once saw no result within a 60 s exchange timeout).
    settings = ExchangeSettings(replicas=n, min_replicas=n, codec="fp32", timeout_s=500)
    url = f"memory://merge-{uuid.uuid4().hex}"
    outcomes: queue.Queue[tuple[int, ExchangeResult | BaseException]] = queue.Queue()

    def run(rank: int) -> None:
        try:
            result = allreduce(
                ObjectStore(url),
                values[rank],
                prefix="rounds/1/0",
                identity={"run_id": "run", "round": "1", "fragment": "0"},
                rank=rank,
                settings=settings,
                grace_s=500,
            )
        except BaseException as e:
            outcomes.put((rank, e))
        else:
            outcomes.put((rank, result))

    for r in range(n):
        threading.Thread(target=run, args=(r,), daemon=True).start()
    # The test waits for the ranks' results, not for their threads to exit: a CI run once sat in
    # ``Thread.join`` for 600 s though no rank's thread had a Python frame left.
    # The short polls recheck the queue, so no missed wake-up can hold the test either.
    results: dict[int, ExchangeResult] = {}
    deadline = time.monotonic() + 550
    while len(results) < n:
        assert time.monotonic() < deadline, f"only ranks {sorted(results)} returned within 550 s"
        try:
            rank, outcome = outcomes.get(timeout=1)
        except queue.Empty:
            continue
        if isinstance(outcome, BaseException):
            raise AssertionError(f"replica {rank}'s allreduce failed") from outcome
        results[rank] = outcome
    assert results[0].participants == list(range(n))
    return results[0].average


def test_equal_weights_merge_bit_identically_to_the_lock_step_exchange() -> None:
    values = [torch.randn(1001, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    lock_step = _lock_step_average(values)
    # Any equal weights (equal tokens and steps under "tokens" give equal tokens^2/steps) take that path.
    for weights in ([1.0, 1.0, 1.0], [2.5e9, 2.5e9, 2.5e9]):
        merged = merge(values, weights)
        assert merged.dtype == torch.float32
        assert merged.view(torch.int32).equal(lock_step.view(torch.int32))
    # The order of summation is part of the contract: another order rounds differently somewhere.
    assert not merge(values[::-1], [1.0] * 3).view(torch.int32).equal(lock_step.view(torch.int32))


def test_weighted_mean_by_hand() -> None:
    a, b = torch.tensor([1.0, 0.0, -4.0]), torch.tensor([3.0, 2.0, 4.0])
    # weights 1 and 3: (1*a + 3*b) / 4
    assert merge([a, b], [1.0, 3.0]).tolist() == [2.5, 1.5, 2.0]
    # Weights as large as tokens^2/steps get (1e6 tokens in 10 steps: 1e11) keep the same shares.
    assert merge([a, b], [1e11, 3e11]).tolist() == [2.5, 1.5, 2.0]


def test_rda_keeps_the_norm_that_a_plain_mean_of_orthogonal_updates_shrinks() -> None:
    e1, e2 = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    assert merge([e1, e2], [1.0, 1.0], "mean").tolist() == [1.0, 1.0]  # norm sqrt(2): shrunk from 2
    rda = merge([e1, e2], [1.0, 1.0], "rda")
    assert torch.allclose(rda, torch.tensor([math.sqrt(2), math.sqrt(2)]))  # norm 2, direction (1, 1)
    # Norms 1 and 3, weights 3 and 1: radius (3*1 + 1*3)/4 = 1.5; direction of (3*(1,0) + 1*(0,1))/4.
    rda = merge([torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])], [3.0, 1.0], "rda")
    direction = torch.tensor([3.0, 1.0]) / math.sqrt(10)
    assert torch.allclose(rda, 1.5 * direction)
    # Identical contributions: RDA is the contribution itself.
    same = torch.tensor([0.5, -1.0, 2.0])
    assert torch.allclose(merge([same, same.clone()], [1.0, 2.0], "rda"), same)


def test_rda_with_zero_contributions() -> None:
    zero, x = torch.zeros(3), torch.tensor([0.0, 4.0, 0.0])
    # The zero counts with norm 0 in the radius (4 / 2 = 2) and adds no direction.
    assert merge([zero, x], [1.0, 1.0], "rda").tolist() == [0.0, 2.0, 0.0]
    assert merge([zero, zero.clone()], [1.0, 1.0], "rda").tolist() == [0.0, 0.0, 0.0]
    # Opposite unit vectors cancel: no direction, no step.
    assert merge([x, -x], [1.0, 1.0], "rda").tolist() == [0.0, 0.0, 0.0]


def test_named_tensors_average_the_embeddings_plainly() -> None:
    contributions = [
        {"embed": torch.tensor([2.0, 0.0]), "layer": torch.tensor([2.0, 0.0])},
        {"embed": torch.tensor([0.0, 2.0]), "layer": torch.tensor([0.0, 2.0])},
    ]
    merged = merge_tensors(contributions, [1.0, 1.0], "rda", plain={"embed"})
    assert merged["embed"].tolist() == [1.0, 1.0]
    assert torch.allclose(merged["layer"], torch.tensor([math.sqrt(2), math.sqrt(2)]))
    with pytest.raises(ValueError, match="same tensors"):
        merge_tensors([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], [1.0, 1.0])


def test_bad_merges_say_what_is_wrong() -> None:
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="no contribution"):
        merge([], [])
    with pytest.raises(ValueError, match="2 contributions but 1 weights"):
        merge([x, x], [1.0])
    with pytest.raises(ValueError, match="positive and finite"):
        merge([x, x], [1.0, 0.0])
    with pytest.raises(ValueError, match="different shapes"):
        merge([x, torch.zeros(3)], [1.0, 1.0])
    with pytest.raises(ValueError, match="'mean' or 'rda'"):
        merge([x], [1.0], "median")  # type: ignore[arg-type]


def test_grace_is_a_share_of_the_slack_the_overlap_hides() -> None:
    # 10 steps of 2 s hide 20 s; the quorum took 5 s and the merge takes 3 s: slack 12 s, half of it 6 s.
    assert grace_window(tau=10, step_s=2.0, quorum_s=5.0, sync_s=3.0, gamma=0.5, bound_s=60.0) == 6.0
    assert grace_window(tau=10, step_s=2.0, quorum_s=5.0, sync_s=3.0, gamma=0.5, bound_s=4.0) == 4.0
    # A quorum slower than the overlap leaves no slack: no wait, never a negative one.
    assert grace_window(tau=1, step_s=2.0, quorum_s=5.0, sync_s=3.0, gamma=0.5, bound_s=60.0) == 0.0
    assert grace_window(tau=10, step_s=2.0, quorum_s=5.0, sync_s=3.0, gamma=0.5, bound_s=math.inf) == 6.0
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\)"):
        grace_window(tau=10, step_s=2.0, quorum_s=0.0, sync_s=0.0, gamma=1.0, bound_s=60.0)
    with pytest.raises(ValueError, match="non-negative"):
        grace_window(tau=10, step_s=-2.0, quorum_s=0.0, sync_s=0.0, gamma=0.5, bound_s=60.0)
