"""A replica's restored learning-rate schedule: at its saved position, under the peak and the length of the
run's config now (a resume may change train.lr and diloco.rounds), and bit for bit the saved one when neither
changed."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from composer_serverless.config import TrainConfig
from composer_serverless.replicas import state
from composer_serverless.replicas.diloco import make_inner_optimizer, make_schedule

CPU = torch.device("cpu")
SAVED_AT = 5  # inner steps before the state is saved: past the warm-up


class _NoData:
    """An objective with no position to save."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        pass


def _replica(train: TrainConfig, total_steps: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    inner = make_inner_optimizer(model, train)
    return model, inner, make_schedule(inner, train, total_steps)


def _step(model: nn.Module, inner: torch.optim.Optimizer, schedule: Any) -> None:
    model(torch.ones(2, 4)).square().sum().backward()
    inner.step()
    inner.zero_grad()
    schedule.step()


def _saved(
    train: TrainConfig, total_steps: int
) -> tuple[dict[str, Any], nn.Module, torch.optim.Optimizer, Any]:
    """The own state after SAVED_AT steps, and the replica that goes on without a restart."""
    model, inner, schedule = _replica(train, total_steps)
    for _ in range(SAVED_AT):
        _step(model, inner, schedule)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return state.own_state(model, inner, schedule, _NoData(), params, CPU), model, inner, schedule


def _restored(saved: dict[str, Any], train: TrainConfig, total_steps: int) -> tuple[nn.Module, Any, Any]:
    model, inner, schedule = _replica(train, total_steps)
    saved = copy.deepcopy(
        saved
    )  # as read back from the store: sharing no tensor with the replica that saved it
    state.restore_own(saved, inner=inner, objective=_NoData(), model=model, schedule=schedule, device=CPU)
    return model, inner, schedule


def test_an_unchanged_schedule_is_restored_bit_for_bit() -> None:
    train = TrainConfig(lr=1e-2, warmup_steps=2, schedule="cosine")
    saved, model, inner, schedule = _saved(train, 20)
    again, inner_again, schedule_again = _restored(saved, train, 20)
    assert [g["lr"] for g in inner_again.param_groups] == [g["lr"] for g in inner.param_groups]
    assert schedule_again.get_last_lr() == schedule.get_last_lr()
    with torch.no_grad():  # the global parameters, as a resume loads them from the published state
        for mine, published in zip(again.parameters(), model.parameters(), strict=True):
            mine.copy_(published)
    _step(model, inner, schedule)
    _step(again, inner_again, schedule_again)
    assert schedule_again.last_epoch == schedule.last_epoch == SAVED_AT + 1
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_new_peak_learning_rate_applies_from_the_first_step_after_the_restore() -> None:
    saved, *_ = _saved(TrainConfig(lr=1e-2, warmup_steps=2, schedule="constant"), 20)
    _, inner, schedule = _restored(saved, TrainConfig(lr=4e-3, warmup_steps=2, schedule="constant"), 20)
    assert schedule.last_epoch == SAVED_AT
    assert (
        [g["lr"] for g in inner.param_groups] == [4e-3, 4e-3] == [g["initial_lr"] for g in inner.param_groups]
    )
    assert schedule.get_last_lr() == [4e-3, 4e-3]


def test_a_cosine_restored_into_a_longer_run_follows_the_longer_cosine_from_there() -> None:
    train = TrainConfig(lr=1e-2, warmup_steps=2, schedule="cosine")
    saved, *_ = _saved(train, 10)
    _, inner, _ = _restored(saved, train, 20)
    _, longer, _ = _replica(train, 20)
    make_schedule(longer, train, 20, done_steps=SAVED_AT)  # the 20-step run's rate at that step
    assert [g["lr"] for g in inner.param_groups] == [g["lr"] for g in longer.param_groups]


def test_a_schedule_placed_over_an_older_saved_optimizer_takes_the_new_peak() -> None:
    """A replica resuming with an own state older than the round it resumes loads the optimizer alone and places
    a new schedule at the round (``Replica._schedule_at``): the saved optimizer's peak is not the run's now."""
    saved, *_ = _saved(TrainConfig(lr=1e-2, warmup_steps=2, schedule="constant"), 20)
    train = TrainConfig(lr=4e-3, warmup_steps=2, schedule="constant")
    model, inner, _ = _replica(train, 20)
    state.restore_own(
        copy.deepcopy(saved), inner=inner, objective=_NoData(), model=model, schedule=None, device=CPU
    )
    schedule = make_schedule(inner, train, 20, done_steps=8)
    assert [g["lr"] for g in inner.param_groups] == [4e-3, 4e-3] and schedule.get_last_lr() == [4e-3, 4e-3]
