"""Micro-batches with gradient accumulation (``train.micro_batch_size``): the step's gradient equals the whole
batch's within 1e-6 in float32, for the lm and the composer objective, and the activation memory follows the
micro-batch, not the batch (a census of device bytes on the simulated accelerator)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import validate_config
from composer_serverless.models.loading import load_model
from composer_serverless.objectives.lm import LMObjective
from composer_serverless.objectives.objective import add_parts, make_objective
from tests.replicas.conftest import tiny_model
from tests.replicas.test_composer_objective import raw  # noqa: F401  (the fixture)


def step_gradients(objective, model) -> tuple[dict[str, torch.Tensor], dict, int]:
    """One step as the trainer runs it: each micro-batch backpropagated before the next; the gradients, the
    metrics' sums and the number of micro-batches."""
    model.zero_grad(set_to_none=True)
    metrics: dict = {}
    parts = 0
    for loss, part in objective.losses(model):
        loss.backward()
        metrics = add_parts(metrics, part)
        parts += 1
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {k: float(v) for k, v in metrics.items()}, parts


def assert_same_gradients(actual, expected) -> None:
    assert actual.keys() == expected.keys() and expected
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=1e-6, msg=name)


def lm_config(model_dir: Path, micro: int | None, batch: int = 6):
    return validate_config(
        {
            "model": {"path": str(model_dir)},
            "data": {"seq_len": 32, "batch_size": batch},
            "train": {"micro_batch_size": micro},
            "diloco": {"replicas": 1, "sync_every": 1, "rounds": 1},
        }
    )


@pytest.mark.parametrize("micro", [1, 4, 6])
def test_lm_micro_batches_add_up_to_the_whole_batch(tiny_model_dir: Path, micro: int) -> None:
    loaded = load_model(lm_config(tiny_model_dir, None).model, tiny_model_dir)
    model = loaded.model.train()
    whole, whole_metrics, one = step_gradients(
        LMObjective(lm_config(tiny_model_dir, None), loaded.tokenizer, 0), model
    )
    parts, metrics, count = step_gradients(
        LMObjective(lm_config(tiny_model_dir, micro), loaded.tokenizer, 0), model
    )
    assert (one, count) == (1, -(-6 // micro))  # 6 rows: 6, 2 and 1 micro-batches
    assert_same_gradients(parts, whole)
    assert metrics["lm/loss"] == pytest.approx(whole_metrics["lm/loss"], abs=1e-6)


@pytest.mark.parametrize(
    ("loss_type", "device"),
    [("grpo", "cpu"), ("bnpo", "cpu"), ("dr_grpo", "cpu"), ("dapo", "cpu"), ("dapo", "cuda")],
    ids=["grpo", "bnpo", "dr_grpo", "dapo", "dapo-simulated-accelerator"],
)
def test_composer_micro_batches_add_up_to_the_whole_batch(raw, tokenizer, loss_type, device) -> None:  # noqa: F811
    """All three channels (GRPO with a KL term, SDPO, DPO): 8 completions and 8 pairs a step, in micro-batches
    of 3 completions and 1 pair, so micro-batches differ in size and the last ones carry pairs alone; once on
    the simulated accelerator, where a host tensor among the micro-batches' operands would raise."""

    def run(micro: int | None):
        config = validate_config(
            {
                **raw(grpo={"loss_type": loss_type, "kl": 0.1}),
                "train": {"objective": "composer", "micro_batch_size": micro},
            }
        )
        model = tiny_model(tokenizer).to(device)
        objective = make_objective(config, tokenizer, 0, model=model)
        # The same rollouts in both runs, every group's rewards differing, at a seed found for the reference
        # engine on the CPU and one for the paged engine, auto's choice on the device.
        torch.manual_seed(2 if device == "cpu" else 26)
        grads, metrics, parts = step_gradients(objective, model.train())
        return {n: g.cpu() for n, g in grads.items()}, metrics, parts

    if device == "cuda":
        with simulated():
            whole, whole_metrics, one = run(None)
            parts, metrics, count = run(3)
    else:
        whole, whole_metrics, one = run(None)
        parts, metrics, count = run(3)

    assert one == 1 and count == 8  # ceil(8 / 3) = 3 for the completions, 8 pairs one at a time
    assert whole_metrics["sdpo/loss"] > 0 and whole_metrics["replay/loss"] > 0
    assert whole_metrics["rollout/frac_zero_std"] == 0  # GRPO's gradient is not zero
    assert_same_gradients(parts, whole)
    for name in (
        "loss/total",
        "grpo/loss",
        "sdpo/loss",
        "replay/loss",
        "grpo/tokens",
        "replay/reward_accuracy",
    ):
        assert metrics[name] == pytest.approx(whole_metrics[name], abs=1e-5), name


def test_activation_memory_follows_the_micro_batch(tiny_model_dir: Path) -> None:
    """Peak device bytes of a step's forwards and backwards over what was live before it, at 4 micro-batch
    sizes of one 8-row batch: the activations of one micro-batch at a time, so the peak grows with the
    micro-batch (nearly in proportion) and one row at a time holds a fraction of the whole batch's."""
    peaks = {}
    for micro in (1, 2, 4, 8):
        config = lm_config(tiny_model_dir, micro, batch=8)
        with simulated() as sim:
            loaded = load_model(config.model, tiny_model_dir)
            model = loaded.model.to("cuda").train()
            objective = LMObjective(config, loaded.tokenizer, 0)
            step_gradients(objective, model)  # gradients allocated: the next step starts where a step does
            before = sim.live_bytes
            sim.reset_peak()
            step_gradients(objective, model)
            peaks[micro] = sim.peak_bytes - before
    assert peaks[1] < peaks[2] < peaks[4] < peaks[8], peaks
    # Activations scale with rows: doubling the micro-batch adds at least 0.7x the one-row extra each time.
    assert peaks[8] - peaks[4] > 0.7 * 4 * (peaks[2] - peaks[1]), peaks
    assert peaks[1] < 0.3 * peaks[8], peaks
