"""Replicas must start from the same weights: DiLoCo averages pseudo-gradients, so a replica that starts
apart stays apart. A checkpoint with a missing weight (which transformers initialises at random) still
starts alike on every replica; weights that differ anyway are refused before any training."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from harness import create, digests, logs_of, make_config, run_replicas

from composer_serverless.models.loading import load_pretrained
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.weights import InitialWeightsError, check_initial_weights, digest

MISSING = "model.layers.0.mlp.down_proj.weight"


def test_different_initial_weights_are_refused_with_the_reason(tiny_model_dir: Path) -> None:
    run = ObjectStore("memory://initial-weights/run")
    model, _ = load_pretrained(tiny_model_dir, "float32")
    check_initial_weights(run, model, rank=0)
    check_initial_weights(run, model, rank=1)  # the same weights: accepted
    with torch.no_grad():
        model.get_parameter(MISSING)[0, 0] += 1e-3
    with pytest.raises(InitialWeightsError, match="replica 2: the model's initial weights differ"):
        check_initial_weights(run, model, rank=2)


@pytest.mark.slow
def test_a_checkpoint_missing_a_weight_starts_alike_on_every_replica(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    partial = tmp_path / "partial"
    model, tokenizer = load_pretrained(tiny_model_dir, "float32")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    weights = safetensors.torch.load_file(partial / "model.safetensors")
    del weights[MISSING]
    safetensors.torch.save_file(weights, partial / "model.safetensors", metadata={"format": "pt"})

    run = create(make_config(f"file://{tmp_path}/runs", "partial", partial, rounds=2))
    codes = run_replicas(run, tmp_path / "logs", 2)
    assert codes == [0, 0], logs_of(tmp_path / "logs")
    per_round = digests(run)
    assert sorted(per_round) == [1, 2] and all(len(d) == 1 for d in per_round.values())
    # The missing weight really was initialised on load (not taken from the full checkpoint): the
    # recorded initial digest is not the complete model's.
    recorded = run.get("state/initial.json")
    assert digest(dict(model.named_parameters())) not in recorded.decode()
