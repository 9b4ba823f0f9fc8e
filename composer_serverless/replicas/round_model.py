"""The global model of any checkpointed round, rebuilt outside the run, for ``export --round``.

A checkpoint holds the global parameters (and the outer optimizer's state) of every fragment, per local rank,
not a model: the model is the run's model as the replicas load it (``load_run_model``) with those parameters
swapped in, saved as the last round's publisher saves ``final/``: the whole model, or with LoRA the adapters,
and the tokenizer. So a round's export and the final one go through the same code after this, and the last
round's equals ``final/``. States are read as the replicas read them: checked against their manifest, and with
the run's key (``diloco.authenticate``) against their MAC.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from composer_serverless.config import RunConfig
from composer_serverless.rendezvous import checkpoint
from composer_serverless.rendezvous.checkpoint import CheckpointError
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.diloco import model_names, split_fragments
from composer_serverless.replicas.weights import load_run_model, swapped_in


def save_round(
    run: ObjectStore, config: RunConfig, round_index: int, out: Path, key: RunKey | None = None
) -> None:
    """Save into ``out`` the global model after round ``round_index``, in ``final/``'s form.

    ``key`` is the key the replicas MAC with (the run key bound to the run id), None for a run without one.

    Raises:
        FileNotFoundError: the round has no complete state (pruned, or never checkpointed).
        CheckpointError: its state is damaged, not written with ``key``, not of this model, or not finite.
    """
    # The download cache lives as long as the model: its weights may stay memory-mapped from its files.
    with tempfile.TemporaryDirectory(prefix="composer-serverless-round-") as cache:
        # The replicas' loading seed, so weights neither the checkpoint nor the state holds (a LoRA run's
        # frozen weights a checkpoint lacks) are initialised as theirs were.
        torch.manual_seed(config.seed)
        loaded = load_run_model(run, config, Path(cache))
        params = round_parameters(run, config, round_index, loaded.model, key)
        with swapped_in(loaded.model, params):
            (loaded.adapters or loaded.model).save_pretrained(out)
        loaded.tokenizer.save_pretrained(out)


def round_parameters(
    run: ObjectStore, config: RunConfig, round_index: int, model: nn.Module, key: RunKey | None = None
) -> dict[str, torch.Tensor]:
    """The whole global parameters of round ``round_index`` by ``model``'s names: every local rank's part of
    the state read, and a replica of several ranks' shards joined (FSDP2 shards each parameter along its first
    dimension, in rank order)."""
    names = model_names(model, split_fragments(model, config.diloco.fragments))
    parts: list[dict[str, torch.Tensor]] = []
    for local in range(config.ranks_per_replica):
        user = checkpoint.load_global(run, round_index, local, key)["user"]
        part = {}
        for i, mapping in enumerate(names):
            originals = user.get(f"StreamingDiLoCoFragment_{i}", {}).get("original_parameters", {})
            if set(originals) != set(mapping):
                raise CheckpointError(
                    f"fragment {i} of round {round_index}'s state (part {local}) does not match the run's "
                    "model's parameters"
                )
            part.update({mapping[name]: tensor for name, tensor in originals.items()})
        parts.append(part)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    whole = {}
    for name in parts[0]:
        tensor = torch.cat([part[name] for part in parts]) if len(parts) > 1 else parts[0][name]
        if tensor.shape != shapes[name]:
            raise CheckpointError(
                f"round {round_index}'s state holds {name} of shape {list(tensor.shape)}, the run's model "
                f"{list(shapes[name])}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"round {round_index}'s state holds non-finite values in {name}: the run had diverged by then"
            )
        whole[name] = tensor
    return whole
