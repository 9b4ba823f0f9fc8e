"""What the forward and backward passes compute in.

With bf16 compute over float32 masters (``model.dtype = "bfloat16"``, ``model.master_dtype = "float32"``),
the weights, and with them torchft's global copy, the outer momentum and AdamW's states, stay float32, and
the passes run under ``torch.autocast``: matrix products in bf16, reductions and the loss in float32. The
inner updates then land in float32 weights, where bf16 weights would round fine-tuning-sized updates away.
Otherwise the passes compute in the weights' own dtype.
"""

from __future__ import annotations

import contextlib

import torch

from composer_serverless.config import ModelConfig


def compute(spec: ModelConfig, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """A fresh context for one stretch of computation (a step's forward, an evaluation)."""
    if spec.dtype == "bfloat16" and spec.master_dtype == "float32":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
