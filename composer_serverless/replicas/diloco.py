"""torchft's DiLoCo wired to this project's pieces: fragments, inner and outer optimizers, the manager's
settings, and the global parameters DiLoCo keeps.

torchft's ``DiLoCo`` hooks the inner optimizer's ``step``: every ``sync_every / fragments`` steps it computes
the pseudo-gradient of one fragment (global - local), has the manager average it, restores the global
parameters and applies the outer optimizer. We supply the manager (``ObjectStoreManager``), the fragments
(strided decoder layers, as in Streaming DiLoCo) and one outer Nesterov SGD per fragment; the algorithm is
torchft's, with the sync's arithmetic and state moved to host memory (``host_diloco.py``, bit for bit the
same).
"""

from __future__ import annotations

import functools
import math
from typing import cast

import torch
from torch import nn

from composer_serverless.config import DiLoCoConfig, TrainConfig
from composer_serverless.rendezvous.codec import Codec, CodecName
from composer_serverless.rendezvous.deadline import GraceSettings
from composer_serverless.rendezvous.exchange import ExchangeSettings
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.sparse import Sparse
from composer_serverless.rendezvous.transfers import Transfers
from composer_serverless.replicas.host_diloco import HostDiLoCo, OuterFactory
from composer_serverless.replicas.shards import decoder_layers


def split_fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """Partition ``model``'s trainable parameters into ``count`` modules, one per Streaming DiLoCo fragment.

    Decoder layers are dealt out strided (layer i to fragment i % count), the pattern Streaming DiLoCo found
    best; parameters outside the layers (embeddings, final norm, a tied head) join fragment 0. The fragments
    hold the model's own Parameter objects, so updates through a fragment are updates of the model.

    Only trainable parameters: torchft exchanges and outer-steps every parameter of a fragment, so a frozen
    one (a LoRA base weight) would travel as zeros and be left with a full-size gradient. Within a fragment
    the widest dtype comes first: torchft packs a fragment into buckets of its first tensor's dtype, so a
    float32 tensor behind a bfloat16 one would be rounded, while widest first every tensor travels at least
    at its own precision (a model that keeps its router in float32, say).
    """
    layer_of: dict[int, int] = {}
    if count > 1:
        layers = decoder_layers(model)
        if layers is None or len(layers) < count:
            raise ValueError(
                f"cannot split the model into {count} fragments: it has {len(layers or [])} decoder layers"
            )
        layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(count)]
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[layer_of.get(id(param), 0) % count].append((name, param))
    fragments = []
    for i, group in enumerate(groups):
        if not group:
            raise ValueError(f"fragment {i} of {count} has no trainable parameter; use fewer fragments")
        fragment = nn.Module()
        for name, param in sorted(group, key=lambda item: -item[1].element_size()):  # stable: model order
            fragment.register_parameter(name.replace(".", "__"), param)
        fragments.append(fragment)
    return fragments


def model_names(model: nn.Module, fragments: list[nn.Module]) -> list[dict[str, str]]:
    """For each fragment, its parameter names mapped to the model's parameter names."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return [{local: by_id[id(p)] for local, p in fragment.named_parameters()} for fragment in fragments]


def make_inner_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, as is standard for transformers) or plain SGD.

    AdamW is fused (torch has the kernel for CUDA and the CPU): one kernel updates each parameter in place,
    where the default (foreach) implementation allocates temporaries as large as the weights at the step's
    peak, 4 bytes per parameter of accelerator memory in float32 (measured on the simulated device). The same
    kernel on both, so a run on the accelerator's path still ends where the CPU run does."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=True)


def make_schedule(
    optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int, done_steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to ``min_lr_ratio`` over the run's inner steps.

    ``done_steps`` starts the schedule part-way, for a replica that joins from a published state. The peak is
    always ``config.lr``, also over an optimizer restored from a state saved with another (a resume may change
    train.lr).
    """

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=done_steps - 1)


def outer_optimizer(config: DiLoCoConfig) -> OuterFactory:
    """The outer SGD of one fragment, over the tensors it is given (the fragment's host copy of the global
    parameters): one per fragment, so each fragment's momentum is saved and restored with that fragment."""
    return functools.partial(
        torch.optim.SGD, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.nesterov
    )


def make_diloco(
    manager: ObjectStoreManager,
    fragments: list[nn.Module],
    inner: torch.optim.Optimizer,
    config: DiLoCoConfig,
) -> HostDiLoCo:
    """torchft's DiLoCo, its outer state in host memory, with one bucket per fragment: the store exchanges one
    object per replica and sync."""
    return HostDiLoCo(
        manager,
        fragments,
        inner,
        outer_optimizer(config),
        sync_every=config.sync_every,
        fragment_sync_delay=config.fragment_sync_delay,
        fragment_update_alpha=config.fragment_update_alpha,
    )


def global_parameters(manager: ObjectStoreManager, names: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """The global (outer) parameters by model name, from the state DiLoCo registered with the manager."""
    state = manager.user_state_dict()
    params = {}
    for i, mapping in enumerate(names):
        originals = state[f"StreamingDiLoCoFragment_{i}"]["original_parameters"]
        params.update({mapping[local]: tensor for local, tensor in originals.items()})
    return params


def exchange_settings(
    config: DiLoCoConfig, local_rank: int = 0, local_ranks: int = 1, key: RunKey | None = None
) -> ExchangeSettings:
    return ExchangeSettings(
        replicas=config.replicas,
        min_replicas=config.min_replicas,
        codec=wire_codec(config.codec, config),
        reduced_codec=wire_codec(config.reduced_codec, config) if config.reduced_codec else None,
        timeout_s=config.sync_timeout_s,
        local_rank=local_rank,
        local_ranks=local_ranks,
        key=key,
        outlier_factor=config.outlier_norm_factor,
    )


def wire_codec(name: str, config: DiLoCoConfig) -> Codec:
    """The codec ``name`` of ``config``: the sparse one carries the run's density."""
    return Sparse(config.sparse_density) if name == "sparse" else cast(CodecName, name)


def transfer_settings(config: DiLoCoConfig) -> Transfers:
    return Transfers(concurrency=config.transfer_concurrency, part_bytes=config.transfer_part_mb << 20)


def grace_settings(config: DiLoCoConfig) -> GraceSettings:
    return GraceSettings(
        min_s=config.quorum_grace_min_s, max_s=config.quorum_grace_max_s, mads=config.quorum_grace_mads
    )
