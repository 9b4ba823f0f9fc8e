"""FSDP2 inside a replica: sharding the model over the replica's ranks, and the local shards behind its
DTensors.

``fully_shard`` per decoder layer and once at the root, as torchtitan does: a layer's parameters are gathered
just before it runs and freed after, so a rank holds 1/G of the weights, gradients and optimizer state plus one
layer at a time. torchft's DiLoCo works on the shards as is (its backups are local tensors); the global state
the replica publishes and its own saved state hold local shards too, so a snapshot of local rank l fits
exactly the l-th shard of a replica with the same number of ranks.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from composer_serverless.losses.logprobs import BACKBONE_FORWARD


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's decoder layers: its longest ModuleList (what every Hugging Face causal LM stacks)."""
    return max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)


def shard_model(
    model: nn.Module, ranks: int, device: torch.device, compute_dtype: torch.dtype | None = None
) -> None:
    """Shard ``model`` in place over the default process group's ``ranks`` ranks: per decoder layer, then the
    rest (embeddings, final norm, head) at the root. Parameters become DTensors; build optimizers after.

    With ``compute_dtype`` (bf16 over float32 masters), FSDP2 gathers each layer's parameters in that dtype
    and frees them after the layer, and reduces gradients in float32 into the float32 shards: autocast's
    weight cache would instead keep a cast of every gathered weight alive until the forward ends, a whole
    unsharded model in bf16 on every rank."""
    mesh = init_device_mesh(device.type, (ranks,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype and torch.float32)
    for layer in decoder_layers(model) or []:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # The composer losses run the backbone without the head (``logprobs.hidden_states``), then the head in
    # chunks: as a forward of the root, so FSDP gathers the root's parameters and reduces their gradients.
    setattr(model, BACKBONE_FORWARD, types.MethodType(_backbone_forward, model))
    register_fsdp_forward_method(model, BACKBONE_FORWARD)


def _backbone_forward(model: nn.Module, **inputs: Any) -> Any:
    return model.base_model(**inputs)


def reshard(model: nn.Module) -> None:
    """Free the whole parameters that forward passes without a backward left gathered (FSDP keeps the root's
    after its forward, for the backward it expects): after an evaluation, so that the model's parameters are
    its shards again, to restore or save, and the next forward gathers them afresh."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor`` (the tensor itself when it is not a DTensor), sharing its storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def whole_of_shard(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor whose shard on this rank is ``shard``, laid out as the parameter ``like``, on every
    rank: an all-gather when ``like`` is a DTensor (every rank calls it with its own shard, one tensor at a
    time, so a rank holds at most one whole parameter beyond its shards); ``shard`` itself when ``like`` is
    not sharded."""
    if not isinstance(like, DTensor):
        return shard
    device = like.to_local().device
    spread = DTensor.from_local(
        shard.to(device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
    return spread.full_tensor()


def shard_of(tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard, laid out as the parameter ``like``, of the whole ``tensor`` that local rank 0 holds
    (None on the other ranks): scattered from rank 0, so only it needs the whole (a collective when ``like`` is
    a DTensor: every rank calls it); ``tensor`` itself when ``like`` is not sharded."""
    if not isinstance(like, DTensor):
        if tensor is None:
            raise ValueError("an unsharded parameter's whole tensor must be given")
        return tensor
    device = like.to_local().device
    source = torch.empty(like.shape, dtype=like.dtype, device=device) if tensor is None else tensor.to(device)
    return distribute_tensor(source, like.device_mesh, like.placements, src_data_rank=0).to_local()


def local_tree(tree: Any) -> Any:
    """``tree`` (nested dicts, lists, tuples) with every DTensor replaced by its local shard: what a snapshot
    stores."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {key: local_tree(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_tree(value) for value in tree)
    return tree


def reshard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` from a snapshot of local shards: make each state tensor of a sharded
    parameter (momentum, Adam's moments) a DTensor laid out like the parameter again, as the optimizer's step
    needs; scalar states (Adam's step count) stay as they are."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor) or param not in optimizer.state:
                continue
            shard = param.to_local()
            state = optimizer.state[param]
            for key, value in state.items():
                if (
                    isinstance(value, torch.Tensor)
                    and not isinstance(value, DTensor)
                    and value.shape == shard.shape
                ):
                    state[key] = DTensor.from_local(
                        value.to(shard.device),
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a sharded ``model`` gathered whole, on CPU, on local rank 0 (empty on
    the others): a collective, so every rank calls it. A tied weight appears once, under its first name, as
    ``save_pretrained`` writes it (the gathered copies no longer share storage for it to notice)."""
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            aliases.add(name)
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: tensor for name, tensor in whole.items() if name not in aliases}
