"""What the forward and backward passes compute in.

With bf16 compute over float32 masters (``model.dtype = "bfloat16"``, ``model.master_dtype = "float32"``),
the weights, and with them torchft's global copy, the outer momentum and AdamW's states, stay float32, and
the passes run under ``torch.autocast``: matrix products in bf16, reductions and the loss in float32. The
inner updates then land in float32 weights, where bf16 weights would round fine-tuning-sized updates away.
Otherwise the passes compute in the weights' own dtype. In a sharded replica FSDP2 casts each gathered layer
instead (``shards.shard_model``), which frees the casts with the layer.
"""

from __future__ import annotations

import contextlib

import torch

from composer_serverless.config import ModelConfig


def compute_dtype(spec: ModelConfig) -> torch.dtype | None:
    """The dtype passes compute in when it differs from the weights' (bf16 over float32 masters), else None."""
    if spec.dtype == "bfloat16" and spec.master_dtype == "float32":
        return torch.bfloat16
    return None


def compute(
    spec: ModelConfig, device: torch.device, *, sharded: bool = False
) -> contextlib.AbstractContextManager[object]:
    """A fresh context for one stretch of computation (a step's forward, an evaluation). A sharded model
    casts in FSDP2's mixed-precision policy instead (``shards.shard_model``), so no autocast there."""
    dtype = compute_dtype(spec)
    if dtype is None or sharded:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
