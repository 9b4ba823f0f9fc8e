"""A simulated CUDA device on a CPU-only machine: the replica's GPU code path, held to CUDA's rules.

Why: the suite runs on CPUs, where every tensor shares one device. A comparison between a GPU parameter and
its host copy (round 1's crash on an H100), a host buffer read while a copy into it is still in flight, a
``.numpy()`` of a device tensor: each passes on a CPU and fails, or silently reads garbage, on every GPU.
Under this simulation the replica takes its CUDA path (``torch.cuda.is_available()`` is true) and:

* **placement**: a tensor created on or moved to ``cuda`` stays in host memory but its storage is marked as
  device memory; it reports ``device == cuda:N`` and ``is_cuda``. Every kernel whose operands mix device and
  host tensors raises the error CUDA raises, except what CUDA allows: copies between the two, host index
  tensors, 0-dim host tensors as scalars. ``.numpy()`` of a device tensor raises as it does on CUDA.
* **asynchronous copies**: a ``non_blocking`` copy between the device and pinned host memory is in flight
  until the next synchronisation (``torch.cuda.synchronize``, an event's or a stream's ``synchronize``, or a
  blocking copy to the host). Reading a host buffer the device is still writing, or writing one it is still
  reading, raises: on a GPU that is a race.
* **host synchronisations**: every operation that makes the host wait for the device (``.item()``,
  ``.tolist()``, ``bool()``, a blocking copy to the host, ``nonzero``, ``equal``, ...) is counted, by operation;
  kernels on device memory are counted by thread (a thread meant to touch host memory only can be held to it).
* **device memory**: live bytes of device storages and their peak (``torch.cuda.max_memory_allocated``).
* the ``torch.cuda`` and ``torch.accelerator`` calls a replica makes (availability, device index, RNG state,
  memory statistics, streams and events), and ``autocast("cuda")``, which runs as CPU autocast.

It does not model concurrency between streams (there is one), several device indices, NCCL, CUDA graphs or
``torch.compile``, or CUDA kernels' numerics: kernels are the CPU's.

How: a ``TorchFunctionMode`` answers ``device``, ``is_cuda`` and moves (``.to``, ``.cuda()``, ``.cpu()``,
``pin_memory``), which never reach the dispatcher on a CPU build; a ``TorchDispatchMode`` sees every kernel
(forward, backward, optimizer), checks its operands and marks its outputs. Marks live on the storages'
Python objects, which PyTorch keeps exactly as long as the storage. Both modes are thread-local, so every
thread started while the simulation is on runs under them too.

Use ``simulated()`` in a test, or set ``COMPOSER_SERVERLESS_SIMULATED_ACCELERATOR=1`` in a replica's
environment (the worker then calls ``install()``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Attributes set on a storage's Python object: on the device; pinned host memory; in flight ("device writes":
# no host access until a synchronisation; "device reads": no host write).
_ON_DEVICE = "_simulated_on_device"
_PINNED = "_simulated_pinned"
_IN_FLIGHT = "_simulated_in_flight"
_DEVICE_WRITES, _DEVICE_READS = "device writes", "device reads"

# Kernels that make the host wait for the device's result.
_SYNCING = frozenset(
    {
        aten._local_scalar_dense,  # .item(), bool(), float(), int()
        aten.equal,
        aten.nonzero,
        aten.masked_select,
        aten._unique2,
        aten.unique_dim,
        aten.unique_consecutive,
        aten.bincount,
    }
)
# Kernels that take host index tensors for a device tensor, as CUDA allows.
_INDEXING = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
_COPIES = frozenset({aten.copy_, aten._copy_from, aten._copy_from_and_resize})


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    # No storage of its own: a DTensor raises RuntimeError (its shard has one: ``on_device``), a sparse tensor
    # NotImplementedError. Neither is placed or pinned by itself.
    except (RuntimeError, NotImplementedError):
        return None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means an accelerator
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return False


class Simulator:
    """The simulated device's state: which storages it holds, what is in flight, the counters.

    Attributes:
        host_syncs: host synchronisations by operation, since the simulation started.
        device_kernels: kernels that touched device memory, by the name of the thread that ran them.
        peak_bytes: the most device bytes live at once since the last ``reset_peak``.
    """

    def __init__(self, devices: int = 8) -> None:
        self.devices = devices
        self.index = 0
        self.host_syncs: Counter[str] = Counter()
        self.device_kernels: Counter[str] = Counter()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._in_flight: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._rng = [torch.zeros(16, dtype=torch.uint8) for _ in range(devices)]
        self._local = threading.local()

    @contextlib.contextmanager
    def to_host(self) -> Iterator[None]:
        """Kernels run in this block put their outputs in host memory: Python asked for ``cpu``. (Kernels
        otherwise follow their operands: autograd's formulas name the real device, the CPU, for device
        tensors.)"""
        before = getattr(self._local, "to_host", False)
        self._local.to_host = True
        try:
            yield
        finally:
            self._local.to_host = before

    @property
    def targets_host(self) -> bool:
        return getattr(self._local, "to_host", False)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    # --- marks --------------------------------------------------------------------------------------

    def on_device(self, t: torch.Tensor) -> bool:
        local = getattr(t, "_local_tensor", None)  # a DTensor is where its shard is
        if local is not None:
            return self.on_device(local)
        storage = _storage(t)
        return storage is not None and getattr(storage, _ON_DEVICE, False)

    def pinned(self, t: torch.Tensor) -> bool:
        storage = _storage(t)
        return storage is not None and getattr(storage, _PINNED, False)

    def mark(self, t: torch.Tensor) -> None:
        """Put ``t``'s storage on the device (its memory counted while it lives)."""
        storage = _storage(t)
        if storage is None or getattr(storage, _ON_DEVICE, False):
            return
        setattr(storage, _ON_DEVICE, True)
        size = storage.nbytes()
        with self._lock:
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._freed, size)

    def _freed(self, size: int) -> None:
        with self._lock:
            self.live_bytes -= size

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def pin(self, t: torch.Tensor) -> None:
        storage = _storage(t)
        if storage is not None:
            setattr(storage, _PINNED, True)

    # --- time ---------------------------------------------------------------------------------------

    def synchronize(self, site: str) -> None:
        """The host waits for the device: every copy in flight has landed."""
        self.host_syncs[site] += 1
        for storage in list(self._in_flight):
            if hasattr(storage, _IN_FLIGHT):
                delattr(storage, _IN_FLIGHT)
        self._in_flight.clear()

    def in_flight(self, t: torch.Tensor, what: str) -> None:
        storage = _storage(t)
        if storage is not None:
            setattr(storage, _IN_FLIGHT, what)
            self._in_flight.add(storage)

    def check_host_access(self, t: torch.Tensor, *, write: bool, op: object) -> None:
        storage = _storage(t)
        state = None if storage is None else getattr(storage, _IN_FLIGHT, None)
        if state == _DEVICE_WRITES or (state == _DEVICE_READS and write):
            doing = "writes" if write else "reads"
            raise RuntimeError(
                f"simulated accelerator: {op} {doing} a host buffer that an asynchronous (non_blocking) copy "
                f"{'into' if state == _DEVICE_WRITES else 'from'} it may still be using: on a GPU this is a race. "
                "Synchronize first (torch.cuda.synchronize(), or an event recorded after the copy)"
            )

    # --- placement ----------------------------------------------------------------------------------

    def move(
        self,
        t: torch.Tensor,
        to_device: bool,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
        copy: bool = False,
        memory_format: torch.memory_format = torch.preserve_format,
    ) -> torch.Tensor:
        """``t.to(device, dtype, ...)`` with the device a simulated one (``to_device``) or the host."""
        dtype = dtype or t.dtype
        if self.on_device(t) == to_device:
            return t.to(dtype=dtype, copy=copy, memory_format=memory_format)
        if to_device:  # host to device
            self.check_host_access(t, write=False, op="a copy to the device")
            out = t.to(dtype=dtype, copy=True, memory_format=memory_format)
            self.mark(out)
            if non_blocking and self.pinned(t):
                self.in_flight(t, _DEVICE_READS)
            return out
        # device to host (the kernel mode decides whether the host waits)
        with self.to_host():
            return t.to(dtype=dtype, non_blocking=non_blocking, copy=True, memory_format=memory_format)


# --- the function mode: what never reaches the dispatcher on a CPU build ----------------------------------


def _to(sim: Simulator, func: Callable, args: tuple, kwargs: dict) -> Any:
    self, rest = args[0], args[1:]
    copy = kwargs.pop("copy", False)
    if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
        other = rest[0]
        non_blocking = kwargs.get("non_blocking", rest[1] if len(rest) > 1 else False)
        return sim.move(self, sim.on_device(other), other.dtype, non_blocking, copy)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
    to_device = sim.on_device(self) if device is None else _is_cuda(device)
    return sim.move(self, to_device, dtype, non_blocking, copy, memory_format or torch.preserve_format)


def _cuda(sim: Simulator, func: Callable, args: tuple, kwargs: dict) -> Any:
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    return sim.move(args[0], True, non_blocking=non_blocking)


def _cpu(sim: Simulator, func: Callable, args: tuple, kwargs: dict) -> Any:
    return sim.move(args[0], False)


def _pin_memory(sim: Simulator, func: Callable, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    if sim.on_device(t):
        raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
    out = t.clone()
    sim.pin(out)
    return out


def _tolist(sim: Simulator, func: Callable, args: tuple, kwargs: dict) -> Any:
    if sim.on_device(args[0]):
        sim.synchronize("tolist")
    else:  # read straight from host memory, no kernel: checked here
        sim.check_host_access(args[0], write=False, op="tolist")
    return func(*args, **kwargs)


def _numpy(sim: Simulator, func: Callable, args: tuple, kwargs: dict) -> Any:
    if sim.on_device(args[0]):
        raise TypeError(
            f"can't convert {sim.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
            "host memory first."
        )
    sim.check_host_access(args[0], write=True, op="numpy")  # the array shares the buffer, writable
    return func(*args, **kwargs)


_HANDLERS: dict[Any, Callable[[Simulator, Callable, tuple, dict], Any]] = {
    torch.Tensor.device.__get__: lambda sim, f, a, k: sim.device if sim.on_device(a[0]) else f(*a, **k),
    torch.Tensor.is_cuda.__get__: lambda sim, f, a, k: sim.on_device(a[0]),
    torch.Tensor.get_device: lambda sim, f, a, k: sim.index if sim.on_device(a[0]) else -1,
    torch.Tensor.is_pinned: lambda sim, f, a, k: sim.pinned(a[0]),
    torch.Tensor.to: _to,
    torch.Tensor.cuda: _cuda,
    torch.Tensor.cpu: _cpu,
    torch.Tensor.pin_memory: _pin_memory,
    torch.Tensor.tolist: _tolist,
    torch.Tensor.numpy: _numpy,
}


class _PlacementMode(TorchFunctionMode):
    def __init__(self, sim: Simulator) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self.sim, func, args, kwargs)
        if _is_cuda(kwargs.get("device")):  # a factory asked for the device
            kwargs["device"] = "cpu"
            pin = kwargs.pop("pin_memory", False)
            out = func(*args, **kwargs)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.sim.mark(t)
            if pin:
                raise RuntimeError("only dense CPU tensors can be pinned")
            return out
        pin = kwargs.get("pin_memory", False)
        if pin:
            kwargs["pin_memory"] = False
        if kwargs.get("device") is None:
            out = func(*args, **kwargs)
        else:
            with self.sim.to_host():  # Python asked for the host explicitly
                out = func(*args, **kwargs)
        if pin:
            self.sim.pin(out)
        return out


# --- the dispatch mode: every kernel -------------------------------------------------------------------


def _written(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            out.extend(t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))
    return out


class _KernelMode(TorchDispatchMode):
    def __init__(self, sim: Simulator) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, FakeTensor) for t in types):
            return func(*args, **(kwargs or {}))  # shapes only (DTensor's sharding propagation): no memory
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            return NotImplemented  # a tensor subclass (DTensor) dispatches itself, back to us with its shards
        kwargs = kwargs or {}
        sim = self.sim
        packet = func._overloadpacket
        tensors = [t for t in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
        placed = [sim.on_device(t) for t in tensors]
        to_host = sim.targets_host and any(placed)
        to_device = any(placed) and not to_host
        if _is_cuda(kwargs.get("device")):  # a factory the function mode did not see (in a backward hook)
            kwargs = {**kwargs, "device": torch.device("cpu")}
            to_device = True
        if packet in _COPIES:
            self._copy(func, args, kwargs)
            to_device = placed[0]  # a copy stays where its destination is
        else:
            if any(placed) and not all(placed):
                self._check_mixed(func, args, tensors, placed)
            self._check_in_flight(func, args, kwargs, tensors, placed)
            if any(placed) and packet in _SYNCING:
                sim.synchronize(str(packet))
        out = func(*args, **kwargs)
        if to_device or any(placed):
            sim.device_kernels[threading.current_thread().name] += 1
        if to_device:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    sim.mark(t)
        elif to_host and packet is aten._to_copy:  # pinned and in flight if non_blocking, else the host waits
            if kwargs.get("non_blocking", False):
                sim.pin(out)
                sim.in_flight(out, _DEVICE_WRITES)
            else:
                sim.synchronize("copy to host")
        return out

    def _check_mixed(self, func: Any, args: tuple, tensors: list, placed: list[bool]) -> None:
        allowed = set()
        if func._overloadpacket in _INDEXING and len(args) > 1:
            allowed = {id(t) for t in pytree.tree_leaves(args[1]) if isinstance(t, torch.Tensor)}
        for t, on in zip(tensors, placed, strict=True):
            if not on and t.dim() > 0 and id(t) not in allowed:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"{self.sim.device} and cpu! (simulated accelerator, in {func})"
                )

    def _check_in_flight(self, func: Any, args: tuple, kwargs: dict, tensors: list, placed: list) -> None:
        if func.is_view:  # a view reads no memory: taking one of a buffer in flight is no access
            return
        host = [t for t, on in zip(tensors, placed, strict=True) if not on]
        states = [getattr(_storage(t), _IN_FLIGHT, None) for t in host]
        if not any(states):
            return
        written = {id(t) for t in _written(func, args, kwargs)}
        for t in host:
            self.sim.check_host_access(t, write=id(t) in written, op=func)

    def _copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        sim = self.sim
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        on_dst, on_src = sim.on_device(dst), sim.on_device(src)
        # An asynchronous copy between the device and pinned memory is the device's, queued on its stream
        # behind the copies already in flight there: no race with them (filling one pinned buffer by parts).
        queued = non_blocking and on_src != on_dst and sim.pinned(src if on_dst else dst)
        if not on_dst and not queued:
            sim.check_host_access(dst, write=True, op=func)
        if not on_src and not queued:
            sim.check_host_access(src, write=False, op=func)
        if on_src and not on_dst:  # device to host
            if non_blocking and sim.pinned(dst):
                sim.in_flight(dst, _DEVICE_WRITES)
            else:
                sim.synchronize("copy_ to host")
        elif on_dst and not on_src and non_blocking and sim.pinned(src):  # host to device, asynchronously
            sim.in_flight(src, _DEVICE_READS)


# --- torch.cuda and torch.accelerator as a replica calls them ---------------------------------------------


class _Stream:
    """One stream: ordering is the program's, so waits are no-ops and synchronising is the device's."""

    sim: Simulator  # set on the classes made for each simulation (``_patches``)
    event: type[_Event]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = self.sim.device

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else self.event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False  # no CUDA graphs here

    def synchronize(self) -> None:
        self.sim.synchronize("Stream.synchronize")

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Event:
    sim: Simulator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._at: float | None = None

    def record(self, stream: Any = None) -> None:
        self._at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.sim.synchronize("Event.synchronize")

    def elapsed_time(self, end: _Event) -> float:
        assert self._at is not None and end._at is not None, "both events must be recorded"
        return (end._at - self._at) * 1000.0


def _cpu_for_cuda(fn: Callable) -> Callable:
    """``fn(device_type, ...)`` with CUDA's autocast state kept as the CPU's, so ``autocast("cuda")`` casts."""

    def mapped(device_type: Any = "cuda", *args: Any, **kwargs: Any) -> Any:
        return fn("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    return mapped


def _index(device: Any, sim: Simulator) -> int:
    if device is None:
        return sim.index
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return sim.index if device.index is None else device.index


TOTAL_MEMORY = 80 * 2**30
"""The simulated device's memory, an H100's: what ``mem_get_info`` and the device's properties report (an
engine that sizes its cache from the free memory sizes it from this)."""


def _patches(sim: Simulator) -> dict[tuple[object, str], Any]:
    """(module or class, attribute) -> what it is while the simulation runs."""

    def set_device(device: Any) -> None:
        sim.index = _index(device, sim)

    def properties(device: Any = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            name="simulated accelerator",
            total_memory=TOTAL_MEMORY,
            major=9,
            minor=0,
            multi_processor_count=132,
        )

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        sim._rng[_index(device, sim)] = state.clone()

    def set_rng_state_all(states: list[torch.Tensor]) -> None:
        for i, state in enumerate(states):
            sim._rng[i] = state.clone()

    def reset_peak(device: Any = None) -> None:
        sim.reset_peak()

    cuda, accelerator = torch.cuda, torch.accelerator
    device_module = torch.get_device_module
    event = type("Event", (_Event,), {"sim": sim})
    stream = type("Stream", (_Stream,), {"sim": sim, "event": event})
    patches: dict[tuple[object, str], Any] = {
        (cuda, "is_available"): lambda: True,
        (cuda, "is_initialized"): lambda: True,
        (cuda, "_lazy_init"): lambda: None,
        (cuda, "device_count"): lambda: sim.devices,
        (cuda, "current_device"): lambda: sim.index,
        (cuda, "set_device"): set_device,
        (cuda, "is_bf16_supported"): lambda *a, **k: True,
        (cuda, "synchronize"): lambda device=None: sim.synchronize("torch.cuda.synchronize"),
        (cuda, "get_device_name"): lambda device=None: "simulated accelerator",
        (cuda, "get_device_properties"): properties,
        (cuda, "get_device_capability"): lambda device=None: (9, 0),
        (cuda, "get_rng_state"): lambda device="cuda": sim._rng[_index(device, sim)].clone(),
        (cuda, "set_rng_state"): set_rng_state,
        (cuda, "get_rng_state_all"): lambda: [s.clone() for s in sim._rng],
        (cuda, "set_rng_state_all"): set_rng_state_all,
        (cuda, "manual_seed"): lambda seed: None,
        (cuda, "manual_seed_all"): lambda seed: None,
        (cuda, "memory_allocated"): lambda device=None: sim.live_bytes,
        (cuda, "max_memory_allocated"): lambda device=None: sim.peak_bytes,
        (cuda, "memory_reserved"): lambda device=None: sim.live_bytes,
        (cuda, "mem_get_info"): lambda device=None: (TOTAL_MEMORY - sim.live_bytes, TOTAL_MEMORY),
        (cuda, "reset_peak_memory_stats"): reset_peak,
        (cuda, "empty_cache"): lambda: None,
        (cuda, "Stream"): stream,
        (cuda, "Event"): event,
        (cuda, "current_stream"): lambda device=None: stream(),
        (cuda, "default_stream"): lambda device=None: stream(),
        (cuda, "stream"): lambda s=None: contextlib.nullcontext(s),
        (accelerator, "is_available"): lambda: True,
        (accelerator, "current_accelerator"): lambda check_available=False: torch.device("cuda"),
        (accelerator, "device_count"): lambda: sim.devices,
        (accelerator, "current_device_index"): lambda: sim.index,
        (accelerator, "set_device_index"): set_device,
        (accelerator, "current_stream"): lambda device=None: stream(),
        (accelerator, "synchronize"): lambda device=None: sim.synchronize("torch.accelerator.synchronize"),
        (accelerator, "max_memory_allocated"): lambda device=None: sim.peak_bytes,
        (accelerator, "memory_allocated"): lambda device=None: sim.live_bytes,
        (accelerator, "reset_peak_memory_stats"): reset_peak,
        (torch, "Stream"): stream,
        # The current accelerator's module is CUDA's (a CPU build answers torch.cpu).
        (torch, "get_device_module"): lambda device=None: (
            cuda if device is None or _is_cuda(device) else device_module(device)
        ),
        (torch, "Event"): event,
    }
    for name in ("is_autocast_enabled", "set_autocast_enabled", "get_autocast_dtype", "set_autocast_dtype"):
        patches[(torch, name)] = _cpu_for_cuda(getattr(torch, name))
    return patches


@contextlib.contextmanager
def simulated(devices: int = 8) -> Iterator[Simulator]:
    """Run the block (and every thread it starts) on a simulated CUDA device; yields its state."""
    sim = Simulator(devices)
    _running.append(sim)
    saved = {key: getattr(*key) for key in _patches(sim)}
    for (owner, name), value in _patches(sim).items():
        setattr(owner, name, value)
    run = threading.Thread.run

    def run_simulated(thread: threading.Thread) -> None:
        with _PlacementMode(sim), _KernelMode(sim):
            run(thread)

    threading.Thread.run = run_simulated  # type: ignore[method-assign]
    try:
        with _PlacementMode(sim), _KernelMode(sim):
            yield sim
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
        _running.remove(sim)


_running: list[Simulator] = []


def active() -> bool:
    """Whether a simulation runs in this process: its ``cuda`` is the CPU, with no CUDA graphs or compiler."""
    return bool(_running)


_installed: contextlib.ExitStack | None = None


def install(devices: int = 8) -> Simulator:
    """Put this whole process on the simulated device, for good (a replica started with ``SIMULATED_ENV``)."""
    global _installed
    if _installed is not None:
        raise RuntimeError("the simulated accelerator is installed already")
    _installed = contextlib.ExitStack()
    return _installed.enter_context(simulated(devices))
