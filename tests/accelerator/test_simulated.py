"""The simulated accelerator refuses what CUDA refuses, allows what CUDA allows, and counts what it says.

Each refusal is checked against its allowed twin, so a simulator that refused everything (or nothing) fails.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from composer_serverless.accelerator.simulated import simulated

MIXED = "Expected all tensors to be on the same device"


def test_tensors_put_on_the_device_report_it_and_host_tensors_do_not() -> None:
    with simulated():
        assert torch.cuda.is_available() and torch.accelerator.is_available()
        on = torch.ones(3, device="cuda")
        host = torch.ones(3)
        assert on.device == torch.device("cuda", 0) and on.is_cuda and on.get_device() == 0
        assert host.device == torch.device("cpu") and not host.is_cuda
        assert (on + 1).device.type == "cuda" and on[1:].device.type == "cuda"  # kernels and views follow
        assert host.to("cuda").device.type == "cuda" and host.cuda().device.type == "cuda"
        assert on.cpu().device.type == "cpu" and on.to("cpu").device.type == "cpu"
        assert host.to(on).device.type == "cuda" and on.to(host).device.type == "cpu"
        model = nn.Linear(4, 2).to("cuda")
        assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert torch.ones(1).device.type == "cpu" and not torch.cuda.is_available()  # all undone after


@pytest.mark.parametrize(
    "op",
    [
        lambda on, host: on + host,
        lambda on, host: torch.equal(on, host),  # round 1's crash on an H100
        lambda on, host: torch.cat([on, host]),
        lambda on, host: on.copy_(host) + host,
        lambda on, host: host.mul_(on),
    ],
    ids=["add", "equal", "cat", "after-copy", "in-place-on-host"],
)
def test_mixed_operands_raise_as_on_cuda(op) -> None:
    with simulated():
        on, host = torch.ones(3, device="cuda"), torch.ones(3)
        with pytest.raises(RuntimeError, match=MIXED):
            op(on, host)


def test_what_cuda_allows_between_device_and_host_passes() -> None:
    with simulated():
        on, host = torch.arange(4.0, device="cuda"), torch.arange(4.0)
        on.copy_(host)  # copies both ways
        host.copy_(on)
        assert on[torch.tensor([0, 2])].tolist() == [0.0, 2.0]  # host indices into a device tensor
        assert (on * torch.tensor(2.0)).device.type == "cuda"  # a 0-dim host tensor is a scalar
        assert torch.equal(on.cpu(), host)


def test_numpy_of_a_device_tensor_raises_as_on_cuda() -> None:
    with simulated():
        with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
            torch.ones(2, device="cuda").numpy()
        assert torch.ones(2).numpy().tolist() == [1.0, 1.0]


def test_a_host_buffer_is_not_read_before_its_asynchronous_copy_lands() -> None:
    with simulated():
        on = torch.arange(3.0, device="cuda")
        pinned = torch.empty(3).pin_memory()
        assert pinned.is_pinned() and not torch.empty(3).is_pinned()
        pinned.copy_(on, non_blocking=True)
        with pytest.raises(RuntimeError, match="race"):
            pinned.sum()
        torch.cuda.synchronize()
        assert pinned.tolist() == [0.0, 1.0, 2.0]
        # Into pageable memory a non_blocking copy is synchronous, as CUDA makes it: no race to report.
        pageable = torch.empty(3)
        pageable.copy_(on, non_blocking=True)
        assert pageable.sum().item() == 3.0
        # .to("cpu", non_blocking=True) lands in pinned memory, in flight until an event says it is there.
        landed = on.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        with pytest.raises(RuntimeError, match="race"):
            landed.tolist()
        event.synchronize()
        assert landed.tolist() == [0.0, 1.0, 2.0]


def test_a_host_buffer_is_not_written_while_the_device_still_reads_it() -> None:
    with simulated():
        source = torch.ones(3).pin_memory()
        on = source.to("cuda", non_blocking=True)
        assert source.sum().item() == 3.0  # reading is safe
        with pytest.raises(RuntimeError, match="race"):
            source.fill_(2.0)
        torch.cuda.current_stream().synchronize()
        source.fill_(2.0)
        assert on.sum().item() == 3.0


def test_asynchronous_copies_queued_on_the_stream_do_not_race_each_other() -> None:
    """Filling one pinned buffer by parts from the device is stream-ordered; the host touching it is not."""
    with simulated():
        on = torch.arange(4.0, device="cuda")
        pinned = torch.empty(4).pin_memory()
        pinned[:2].copy_(on[:2], non_blocking=True)
        pinned[2:].copy_(on[2:], non_blocking=True)  # the same storage, queued behind the first copy
        back = torch.empty(4, device="cuda")
        back.copy_(pinned, non_blocking=True)  # the device reads it in stream order too
        with pytest.raises(RuntimeError, match="race"):
            pinned[:2].copy_(torch.zeros(2))  # a host write: a race
        torch.cuda.synchronize()
        assert pinned.tolist() == [0.0, 1.0, 2.0, 3.0] and back.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_host_synchronisations_are_counted_by_operation() -> None:
    with simulated() as sim:
        on = torch.tensor([0.0, 1.0, 2.0], device="cuda")
        on.sum().item()
        bool(on.any())
        on.tolist()
        on.nonzero()
        on.cpu()
        (on * 2).sum()  # no wait
        torch.ones(3).sum().item()  # a host tensor: no wait either
    assert sim.host_syncs == {
        "aten._local_scalar_dense": 2,
        "tolist": 1,
        "aten.nonzero": 1,
        "copy to host": 1,
    }


def test_device_memory_is_counted_while_it_lives() -> None:
    with simulated() as sim:
        before = sim.live_bytes
        a = torch.empty(1000, device="cuda")
        view = a[10:]
        assert sim.live_bytes - before == 4000
        b = torch.empty(500, dtype=torch.float64, device="cuda")
        assert sim.live_bytes - before == 8000
        del a
        assert sim.live_bytes - before == 8000  # the view keeps the storage
        del view, b
        assert sim.live_bytes == before
        assert torch.cuda.max_memory_allocated() - before == 8000
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == sim.live_bytes


def test_free_memory_and_the_accelerators_module_are_cudas() -> None:
    """What an engine sizing its cache from the free memory reads (transformers' continuous batching), and
    the module ``torch.get_device_module()`` answers for the current accelerator (a CPU build: torch.cpu)."""
    from composer_serverless.accelerator.simulated import TOTAL_MEMORY, active

    assert not active()
    with simulated() as sim:
        assert active()
        a = torch.empty(1000, device="cuda")
        assert torch.cuda.mem_get_info() == (TOTAL_MEMORY - sim.live_bytes, TOTAL_MEMORY)
        assert torch.cuda.memory_reserved() == sim.live_bytes >= 4000
        assert torch.get_device_module() is torch.cuda and torch.get_device_module("cpu") is torch.cpu
        stream = torch.get_device_module().Stream(device=a.device)  # as transformers makes its own
        assert stream.device == torch.device("cuda", 0)
    assert not active()


def test_autocast_on_cuda_computes_in_bf16_and_gradients_stay_on_the_device() -> None:
    with simulated():
        model = nn.Linear(4, 4).to("cuda")
        x = torch.randn(2, 4, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        assert y.dtype == torch.bfloat16 and y.device.type == "cuda"
        y.float().sum().backward()
        assert model.weight.grad.device.type == "cuda" and model.weight.grad.dtype == torch.float32


def test_threads_started_inside_run_on_the_device_too() -> None:
    seen: list[BaseException] = []

    def mix(on: torch.Tensor) -> None:
        try:
            on + torch.ones(3)
        except RuntimeError as e:
            seen.append(e)

    with simulated():
        thread = threading.Thread(target=mix, args=(torch.ones(3, device="cuda"),))
        thread.start()
        thread.join()
    assert len(seen) == 1 and MIXED in str(seen[0])


def test_a_training_step_on_the_device_equals_the_same_step_on_the_cpu() -> None:
    """The simulation changes placement, not arithmetic: kernels are the CPU's, so a step matches bit for bit
    (AdamW takes its foreach path on a "cuda" device, as it does on a GPU)."""

    def step(device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(5, 8).to(device)
        for _ in range(3):
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]

    on_cpu = step("cpu")
    with simulated() as sim:
        on_device = step("cuda")
    assert all(torch.equal(a, b) for a, b in zip(on_cpu, on_device, strict=True))
    assert sim.host_syncs["copy to host"] == 4  # the four parameters read back, nothing else waited
