"""Phase times: summed per phase between reads, on the device's clock (events on CUDA, here simulated)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from composer_serverless.accelerator.clock import PhaseClock
from composer_serverless.accelerator.simulated import simulated


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_laps_add_up_per_phase_and_a_read_starts_afresh(device: str) -> None:
    with simulated() if device == "cuda" else contextlib.nullcontext():
        clock = PhaseClock(torch.device(device))
        with pytest.raises(RuntimeError, match="before start"):
            clock.lap("x")
        for _ in range(2):
            clock.start()
            time.sleep(0.02)
            clock.lap("a")
            clock.lap("b")
        read = clock.read()
        # The sleeps bound phase a from below, whatever the machine's load; phase b ran nothing.
        assert read.keys() == {"a", "b"} and read["a"] >= 0.04 and read["b"] >= 0
        assert clock.read() == {}
