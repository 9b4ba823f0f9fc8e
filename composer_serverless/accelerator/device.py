"""The device a replica rank computes on, and what must follow it: its RNG state, and waiting for it.

No silent fallback: a replica whose executor gave it GPUs (``ACCELERATOR_ENV``) and that finds none stops
with the reason. Training on the CPU of a container billed as a GPU would cost the GPU's price at a
hundredth of its speed, with nothing in the logs to say so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from composer_serverless.accelerator import ACCELERATOR_ENV, simulated

logger = logging.getLogger(__name__)

# The device RNG state of a snapshot, under the device type it came from.
_RNG_KEY = "device"


class NoAcceleratorError(RuntimeError):
    """The replica was given GPUs and torch sees none."""


def replica_device(local_rank: int = 0, environ: Mapping[str, str] = os.environ) -> torch.device:
    """``cuda:local_rank`` where torch sees a GPU, else the CPU, unless the executor said there are GPUs.

    Raises:
        NoAcceleratorError: ``ACCELERATOR_ENV`` says this replica has GPUs and torch finds none (or fewer
            than its local rank needs), with what torch says about why.
    """
    expected = environ.get(ACCELERATOR_ENV, "")
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        return torch.device("cuda", local_rank)
    if expected != "cuda":
        return torch.device("cpu")
    raise NoAcceleratorError(
        f"this replica was given GPUs ({ACCELERATOR_ENV}=cuda) but torch {torch.__version__} "
        f"{_why_no_cuda(local_rank)}. Training on the CPU would bill the GPU for nothing, so the replica "
        "stops here. Fix: run the image the plan names (its torch build and driver floor are in "
        "`launch --dry-run`), or check the executor's GPU settings"
    )


def _why_no_cuda(local_rank: int) -> str:
    if torch.version.cuda is None:
        return "is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        torch.cuda.init()
    except Exception as e:  # the driver's own words: too old, no device, ...
        return f"(CUDA {torch.version.cuda}) cannot start CUDA: {e}"
    count = torch.cuda.device_count()
    where = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
    return f"(CUDA {torch.version.cuda}) sees {count} GPUs{where}, and local rank {local_rank} needs one of its own"


def synchronize(device: torch.device) -> None:
    """Wait until every copy and kernel queued on ``device`` has finished: before the host reads or writes a
    pinned buffer that an asynchronous copy may still be using."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def captures_graphs(device: torch.device) -> bool:
    """Whether work on ``device`` can be compiled and captured in CUDA graphs: a real CUDA device only. The
    simulated one models neither, and on a CPU, compiling a decoder costs more than a rollout saves."""
    return device.type == "cuda" and not simulated.active()


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's device RNG state (none on the CPU), under its device type: only its own device's, so a
    resume with fewer GPUs visible restores it too."""
    if device.type != "cuda":
        return {}
    return {_RNG_KEY: {"type": "cuda", "state": torch.cuda.get_rng_state(device)}}


def restore_rng_state(saved: Mapping[str, Any], device: torch.device) -> None:
    """Restore what ``rng_state`` saved; on another device type the sampling stream cannot continue as it
    was, and the log says so instead of changing it silently."""
    entry = saved.get(_RNG_KEY)
    kind = None if entry is None else entry["type"]
    here = "cuda" if device.type == "cuda" else None  # a CPU run saves no device state
    if kind == here:
        if entry is not None:
            torch.cuda.set_rng_state(entry["state"], device)
    else:
        logger.warning(
            "the saved state is of a %s run and this replica runs on %s: sampling continues from a new "
            "random stream, not the interrupted one (the run is not bit-identical to an uninterrupted one)",
            kind or "CPU",
            device.type.upper() if device.type == "cuda" else "the CPU",
        )
