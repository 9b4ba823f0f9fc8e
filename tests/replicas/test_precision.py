"""bf16 compute over float32 masters keeps fine-tuning-sized updates that bf16 weights round away: the probe of
the real-models issue, 3 AdamW steps at lr 1e-5, counting the elements of a weight matrix that changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer_serverless.config import validate_config
from composer_serverless.models.loading import load_model
from composer_serverless.objectives.lm import LMObjective
from composer_serverless.objectives.objective import step_loss
from composer_serverless.replicas import precision
from composer_serverless.replicas.diloco import make_inner_optimizer


def changed_after_three_steps(model_dir: Path, **model: str) -> float:
    config = validate_config(
        {
            "model": {"path": str(model_dir), **model},
            "data": {"seq_len": 32, "batch_size": 4},
            "train": {"lr": 1e-5, "weight_decay": 0.0},
            "diloco": {"replicas": 1, "sync_every": 1, "rounds": 1},
        }
    )
    torch.manual_seed(0)
    loaded = load_model(config.model, model_dir)
    model_, objective = loaded.model.train(), LMObjective(config, loaded.tokenizer, rank=0)
    inner = make_inner_optimizer(model_, config.train)
    weight = dict(model_.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    before = weight.detach().clone()
    for _ in range(3):
        with precision.compute(config.model, torch.device("cpu")):
            loss, _ = step_loss(objective, model_)
        loss.backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
    return (weight.detach() != before).float().mean().item()


def test_float32_masters_keep_the_updates_bf16_weights_round_away(tiny_model_dir: Path) -> None:
    masters = changed_after_three_steps(tiny_model_dir, dtype="bfloat16")
    pure = changed_after_three_steps(tiny_model_dir, dtype="bfloat16", master_dtype="bfloat16")
    fp32 = changed_after_three_steps(tiny_model_dir)
    assert masters >= 0.8 and fp32 >= 0.8, (masters, fp32)
    assert pure < 0.5 * masters, (pure, masters)


def test_bf16_compute_computes_in_bf16_over_float32_weights(tiny_model_dir: Path) -> None:
    def spec(**model: str):
        return validate_config(
            {"model": {"path": str(tiny_model_dir), **model}, "diloco": {"sync_every": 1, "rounds": 1}}
        ).model

    loaded = load_model(spec(dtype="bfloat16"), tiny_model_dir)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    ids = torch.tensor([[1, 2, 3, 4]])
    with precision.compute(spec(dtype="bfloat16"), torch.device("cpu")):
        hidden = loaded.model.model.layers[0].mlp.up_proj(loaded.model.model.embed_tokens(ids))
    assert hidden.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="compute in more precision than the weights hold"):
        spec(master_dtype="bfloat16")
