"""The syncer's outer optimizers (syncer/outer.py): Delayed Nesterov against torch and by hand; their state
as bytes without pickle."""

from __future__ import annotations

import pickle

import pytest
import torch

from composer_serverless.rendezvous.checkpoint import CheckpointError
from composer_serverless.syncer.outer import DelayedNesterov, load_state_bytes, outer_optimizer, state_bytes


def _pseudo_gradients(steps: int, shapes: list[tuple[int, ...]]) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(steps)]


def _run(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]
) -> None:
    for step in grads:
        for param, grad in zip(params, step, strict=True):
            param.grad = grad.clone()
        optimizer.step()


def test_a_delay_of_one_is_torchs_nesterov_bit_for_bit() -> None:
    shapes = [(7, 5), (13,)]
    start = [torch.randn(shape, generator=torch.Generator().manual_seed(1)) for shape in shapes]
    grads = _pseudo_gradients(5, shapes)
    ours = [t.clone() for t in start]
    torchs = [t.clone() for t in start]
    _run(DelayedNesterov(ours, lr=0.7, momentum=0.9, delay=1), ours, grads)
    _run(torch.optim.SGD(torchs, lr=0.7, momentum=0.9, nesterov=True), torchs, grads)
    for a, b in zip(ours, torchs, strict=True):
        assert a.view(torch.int32).equal(b.view(torch.int32))


@pytest.mark.parametrize(
    ("activation", "expected"),
    [
        # c = 0. t1: theta = 1 - 0.5*(1/2) = 0.75. t2: Delta = 4, m = 2, theta = 0.75 - 0.5*(3/2 + 0.5*2) = -0.5.
        # t3: theta = -0.5 - 0.5*(2/2) = -1. t4: Delta = 4, m = 0.5*2 + 2 = 3, theta = -1 - 0.5*(1 + 1.5) = -2.25.
        (0.0, [0.75, -0.5, -1.0, -2.25]),
        # c = 0.25 (<= 1/N). t1: no momentum yet: 0.75. t2: m = 2, theta = 0.75 - 0.5*(1.5 + 0.75*0.5*2) = -0.375.
        # t3: theta = -0.375 - 0.5*(1 + 0.25*0.5*2) = -1. t4: m = 3, theta = -1 - 0.5*(1 + 0.75*0.5*3) = -2.0625.
        (0.25, [0.75, -0.375, -1.0, -2.0625]),
    ],
)
def test_a_delay_of_two_by_hand(activation: float, expected: list[float]) -> None:
    theta = torch.tensor([1.0])
    optimizer = DelayedNesterov([theta], lr=0.5, momentum=0.5, delay=2, activation=activation)
    seen = []
    for g in (1.0, 3.0, 2.0, 2.0):
        theta.grad = torch.tensor([g])
        optimizer.step()
        seen.append(theta.item())
    assert seen == expected


def test_after_each_block_it_is_nesterov_on_the_blocks_mean() -> None:
    """With c = 0, after every N-th update Delayed Nesterov has taken the Nesterov steps of the blocks' means:
    the same sums in another order, so equal to rounding."""
    grads = _pseudo_gradients(6, [(50,)])
    delayed, plain = torch.zeros(50), torch.zeros(50)
    optimizer = DelayedNesterov([delayed], lr=0.3, momentum=0.8, delay=3)
    sgd = torch.optim.SGD([plain], lr=0.3, momentum=0.8, nesterov=True)
    for block in (grads[:3], grads[3:]):
        _run(optimizer, [delayed], block)
        plain.grad = sum(step[0] for step in block) / 3
        sgd.step()
        torch.testing.assert_close(delayed, plain)


@pytest.mark.parametrize("delay", [1, 3])
def test_state_round_trips_through_safetensors_bytes(delay: int) -> None:
    shapes = [(4, 3), (6,)]
    grads = _pseudo_gradients(7, shapes)  # stops mid-block for delay 3: the Delta buffer is in the state
    params = [torch.ones(shape) for shape in shapes]
    optimizer = outer_optimizer(params, lr=0.5, momentum=0.9, nesterov=True, delay=delay)
    _run(optimizer, params, grads[:4])
    data = state_bytes(optimizer)
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(data)  # safetensors, not a pickle
    resumed_params = [p.clone() for p in params]
    resumed = outer_optimizer(resumed_params, lr=0.5, momentum=0.9, nesterov=True, delay=delay)
    load_state_bytes(resumed, data)
    _run(optimizer, params, grads[4:])
    _run(resumed, resumed_params, grads[4:])
    for a, b in zip(params, resumed_params, strict=True):
        assert a.equal(b)
    with pytest.raises(CheckpointError, match="not an outer optimizer's state"):
        load_state_bytes(resumed, b"\x80\x04garbage")


def test_the_factory_and_bad_settings() -> None:
    p = [torch.zeros(2)]
    assert type(outer_optimizer(p, lr=1.0, momentum=0.9, nesterov=True)) is torch.optim.SGD
    assert isinstance(outer_optimizer(p, lr=1.0, momentum=0.9, nesterov=True, delay=2), DelayedNesterov)
    with pytest.raises(ValueError, match="needs nesterov = true"):
        outer_optimizer(p, lr=1.0, momentum=0.9, nesterov=False, delay=2)
    with pytest.raises(ValueError, match=r"c must be in \[0, 1/N\]"):
        DelayedNesterov(p, lr=1.0, momentum=0.9, delay=2, activation=0.6)
    with pytest.raises(ValueError, match="momentum in"):
        DelayedNesterov(p, lr=1.0, momentum=0.0, delay=2)
    with pytest.raises(ValueError, match="delay N must be >= 1"):
        DelayedNesterov(p, lr=1.0, momentum=0.9, delay=0)


def test_merges_of_several_count_in_contributions() -> None:
    """N = 4, merges of 2 (a quorum of 2 of 4), c = 0: each merge steps 2/4 of the way, the momentum is
    updated after every 4 contributions, on their mean. By hand, lr 0.5, beta 0.5, theta 1:
    m1 (g 2): theta = 1 - 0.5*(2/2) = 0.5. m2 (g 4): Delta = 2*2 + 2*4 = 12, m = 12/4 = 3,
    theta = 0.5 - 0.5*(4/2 + 0.5*3) = -1.25. m3 (g 2): -1.25 - 0.5*1 = -1.75.
    m4 (g 2): m = 0.5*3 + (4 + 4)/4 = 3.5, theta = -1.75 - 0.5*(1 + 1.75) = -3.125.
    A merge of 3, then of 1 (4 again): m5 (g 4, k 3): -3.125 - 0.5*(3*4/4) = -4.625;
    m6 (g 4, k 1): m = 1.75 + 16/4 = 5.75, theta = -4.625 - 0.5*(1 + 2.875) = -6.5625."""
    theta = torch.tensor([1.0])
    optimizer = DelayedNesterov([theta], lr=0.5, momentum=0.5, delay=4)
    seen = []
    for g, k in ((2.0, 2), (4.0, 2), (2.0, 2), (2.0, 2), (4.0, 3), (4.0, 1)):
        theta.grad = torch.tensor([g])
        optimizer.step(count=k)
        seen.append(theta.item())
    assert seen == pytest.approx([0.5, -1.25, -1.75, -3.125, -4.625, -6.5625], rel=1e-6)
    assert optimizer.state[theta]["step"] == 12
    with pytest.raises(ValueError, match="at least one contribution"):
        optimizer.step(count=0)


def test_merges_of_every_learner_are_torchs_nesterov_bit_for_bit() -> None:
    """Every merge a mean of all N = 3 (odd, so a k * g / N round trip would not be exact): torch's SGD."""
    shapes = [(7, 5), (13,)]
    start = [torch.randn(shape, generator=torch.Generator().manual_seed(2)) for shape in shapes]
    grads = _pseudo_gradients(5, shapes)
    ours, torchs = [t.clone() for t in start], [t.clone() for t in start]
    optimizer = DelayedNesterov(ours, lr=0.7, momentum=0.9, delay=3)
    for step in grads:
        for param, grad in zip(ours, step, strict=True):
            param.grad = grad.clone()
        optimizer.step(count=3)
    _run(torch.optim.SGD(torchs, lr=0.7, momentum=0.9, nesterov=True), torchs, grads)
    for a, b in zip(ours, torchs, strict=True):
        assert a.view(torch.int32).equal(b.view(torch.int32))
