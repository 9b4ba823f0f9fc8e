"""What a replica measures of its steps and rounds, for the round's metrics row (``metrics/{rank}/{k}.json``).

Per inner step (``step_rows``, what the trackers draw): the loss and the objective's metrics, the learning
rate, the gradient norm, the tokens trained and their rate, generation's rate, the step's time split
(generation, forward and backward, optimizer, sync) and the device's peak memory. Per round: their means,
the traffic, the time blocked on the store, and with error feedback (the sparse codec) how much of what the
inputs were to send they carried. Values that live on the device (the losses, the gradient norms)
and the device's clock are read once a round, so measuring never makes the host wait for the device after a
step; only the loss is read at every step, to discard a non-finite one before the optimizer sees it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from composer_serverless.accelerator.clock import PhaseClock
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.telemetry import mean_metrics

# The metric holding the tokens a step's loss was taken over: the lm objective's trained targets, or the
# composer objective's RL completion tokens (its other channels train on the same completions).
TRAINED_TOKENS = ("lm/tokens", "grpo/tokens")


def read_step(loss: torch.Tensor, metrics: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The step's loss and metrics as floats, those on the device read in one transfer: each ``float()`` of
    a device tensor would make the host wait for the device once more."""
    on_device = {
        name: v for name, v in metrics.items() if isinstance(v, torch.Tensor) and v.device == loss.device
    }
    values = torch.stack([loss.detach().float(), *(v.detach().float() for v in on_device.values())]).tolist()
    read = dict(zip(on_device, values[1:], strict=True))
    return values[0], {name: read[name] if name in read else float(v) for name, v in metrics.items()}


def trained_tokens(metrics: dict[str, float]) -> float | None:
    return next((metrics[name] for name in TRAINED_TOKENS if name in metrics), None)


def step_row(
    metrics: dict[str, float],
    *,
    loss: float,
    lr: float,
    grad_norm: float,
    phases: dict[str, float],
    sync_s: float,
    peak_bytes: int | None,
) -> dict[str, Any]:
    """One step's row: ``phases`` are its seconds on the device's clock (forward, backward, optimizer),
    ``sync_s`` the part of the optimizer's that the training thread was held by DiLoCo's syncs."""
    generate = metrics.get("rollout/generate_s", 0.0)
    step_s = sum(phases.values())
    tokens = trained_tokens(metrics)
    generated = metrics.get("rollout/tokens")
    return {
        **metrics,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s if tokens is not None and step_s > 0 else None,
        "generate_tokens_per_s": generated / generate if generated is not None and generate > 0 else None,
        "time_s": {
            "generate": generate,
            "forward_backward": max(0.0, phases.get("forward", 0.0) + phases.get("backward", 0.0) - generate),
            "optimizer": max(0.0, phases.get("optimizer", 0.0) - sync_s),
            "sync": sync_s,
            "step": step_s,
        },
        "device_peak_bytes": peak_bytes,
    }


class RoundMeter:
    """The steps of the round in progress (since the last round ended, or the replica jumped): their loss
    and metrics, time (per phase, on the device's clock), blocking, traffic and peak device memory."""

    def __init__(self, manager: ObjectStoreManager, device: torch.device) -> None:
        self._manager = manager
        self._device = device
        self._cuda = device.type == "cuda"
        self.clock = PhaseClock(device)
        self.reset()

    def reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.metrics: list[dict[str, float]] = []
        self._norms: list[torch.Tensor] = []
        self._steps: list[dict[str, Any]] = []
        self.steps = 0
        self._started = time.monotonic()
        self._blocked = self._manager.blocked_s
        self._up = self._manager.bytes_up
        self._down = self._manager.bytes_down
        self._carried = (self._manager.carried_total, self._manager.carried_syncs)
        self.clock.read()  # laps of the discarded steps
        self._step_blocked = self._blocked
        self._last_step_end = self._started

    def start_step(self) -> None:
        self.clock.start()
        self._step_blocked = self._manager.blocked_s
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self._device)

    def end_step(
        self, loss: torch.Tensor, value: float, metrics: dict[str, float], lr: float, grad_norm: torch.Tensor
    ) -> float | None:
        """Record a step taken; returns its trained tokens per second by the host's clock (the heartbeat's
        figure: the row's, on the device's clock, is read at the round's end)."""
        self.steps += 1
        self.losses.append(loss)
        self.metrics.append(metrics)
        self._norms.append(grad_norm.detach().float().reshape(()))
        self._steps.append(
            {
                "metrics": metrics,
                "loss": value,
                "lr": lr,
                "sync_s": self._manager.blocked_s - self._step_blocked,
                "peak_bytes": torch.cuda.max_memory_allocated(self._device) if self._cuda else None,
            }
        )
        now = time.monotonic()
        elapsed, self._last_step_end = now - self._last_step_end, now
        tokens = trained_tokens(metrics)
        return tokens / elapsed if tokens is not None and elapsed > 0 else None

    def row(self, lr: float) -> dict[str, Any]:
        """The round's row: its means, traffic and time, and a row per step (``step_rows``)."""
        blocked = self._manager.blocked_s - self._blocked
        stretches = [s for s in self.clock.read_stretches() if "optimizer" in s]  # the steps taken
        norms = torch.stack(self._norms).tolist() if self._norms else []
        steps = [
            step_row(
                s["metrics"],
                loss=s["loss"],
                lr=s["lr"],
                grad_norm=norm,
                phases=phases,
                sync_s=s["sync_s"],
                peak_bytes=s["peak_bytes"],
            )
            for s, norm, phases in zip(self._steps, norms, stretches, strict=True)
        ]
        peaks = [s["device_peak_bytes"] for s in steps if s["device_peak_bytes"] is not None]
        carried = self._manager.carried_syncs - self._carried[1]
        return {
            "train_loss": float(torch.stack(self.losses).float().mean()) if self.losses else None,
            "train": mean_metrics(self.metrics),
            "steps": self.steps,
            "lr": lr,
            "bytes_up": self._manager.bytes_up - self._up,
            "bytes_down": self._manager.bytes_down - self._down,
            "round_s": time.monotonic() - self._started,
            "blocked_s": blocked,
            "time_s": _round_phases(steps),
            "device_peak_bytes": max(peaks) if peaks else None,
            "step_rows": steps,
            "time": time.time(),
            # With error feedback (the sparse codec): the mean share of what this rank's inputs were to send
            # that they carried, over the round's syncs (``feedback.carried_share``).
            **(
                {"codec_carried": (self._manager.carried_total - self._carried[0]) / carried}
                if carried
                else {}
            ),
        }


def _round_phases(steps: list[dict[str, Any]]) -> dict[str, float]:
    """The round's step time split: generation (composer), forward and backward, the optimizer, and the
    syncs DiLoCo ran inside the optimizer's step (the time the training thread was held by them)."""
    phases = ("generate", "forward_backward", "optimizer", "sync")
    return {phase: sum(s["time_s"][phase] for s in steps) for phase in phases}
