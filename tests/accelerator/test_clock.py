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


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_stretches_are_read_apart_and_add_up_to_the_read(device: str) -> None:
    with simulated() if device == "cuda" else contextlib.nullcontext():
        clock = PhaseClock(torch.device(device))
        for pause in (0.03, 0.0):
            clock.start()
            time.sleep(pause)
            clock.lap("a")
        clock.start()  # a stretch without laps (a discarded step) reads as nothing
        stretches = clock.read_stretches()
        assert len(stretches) == 2 and stretches[0]["a"] >= 0.03 and stretches[1].keys() == {"a"}
        assert clock.read_stretches() == [] and clock.read() == {}
