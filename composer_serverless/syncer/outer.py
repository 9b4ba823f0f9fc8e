"""The syncer's outer optimizers over the global's CPU tensors, and their state as bytes without pickle.

Each merged pseudo-gradient is set as the parameters' ``.grad`` and the outer optimizer steps, as torchft's
DiLoCo does in lock-step mode (``replicas/diloco.py``), so with ``delay = 1`` the outer step is the very same
``torch.optim.SGD(nesterov=True)`` lock-step uses.

``DelayedNesterov`` (Liu et al., "Asynchronous Local-SGD Training for Language Modeling", arXiv 2401.09135,
Algorithm "Delayed Nesterov"): applied once per arriving pseudo-gradient, plain Nesterov decays its momentum
k times for k updates in a row and amplifies the step, which is why naive asynchronous DiLoCo loses to the
synchronous kind. Delayed Nesterov updates the momentum only once every ``delay`` (N) pseudo-gradients:

- in between, ``theta -= lr * (g / N + c * beta * m)`` and ``g`` is added to a buffer ``Delta``;
- at every N-th, ``m <- beta * m + Delta / N``, ``theta -= lr * (g / N + (1 - c * N + c) * beta * m)``, and
  ``Delta`` is emptied.

The paper's server applies one learner's pseudo-gradient at a time. This syncer's merges are means of ``k``
contributions (a quorum, and whoever arrived in the grace window), so the count is kept in contributions: a
merge of ``k`` (``step(count=k)``) weighs ``k / N`` (``theta -= lr * (k g / N + ...)``), adds ``k g`` to
``Delta``, and the momentum is updated once N or more have arrived since the last update, on their mean
(``Delta`` over their count). With ``k = 1`` that is the paper's algorithm; with every merge a mean of all N
it is torch's Nesterov SGD, bit for bit; in between, the outer step per N contributions is lock-step's (a
step of ``lr`` times their mean, one momentum update), however the merges group them. Counting merges instead
would make a quorum of 2 of 4 learners apply half of lock-step's step (measured, ``docs/RESULTS.md``).

``c`` (``activation``, in [0, 1/N], 0 by default as in the paper) lets some momentum act between updates;
over a block of N the momentum's total weight is still ``beta * m``. With N = 1 it is torch's Nesterov SGD,
bit for bit.

The state travels as one safetensors file (``state_bytes``/``load_state_bytes``): the tensors as tensors, the
rest as JSON in the file's metadata (``rendezvous/checkpoint.flatten``), so reading it back unpickles nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import safetensors.torch
import torch

from composer_serverless.rendezvous.checkpoint import CheckpointError, flatten, unflatten
from composer_serverless.rendezvous.codec import read_header

_STATE = "optimizer_state"


class DelayedNesterov(torch.optim.Optimizer):
    """Nesterov momentum updated once every ``delay`` pseudo-gradients; see the module docstring.

    Per parameter the state holds ``step`` (the pseudo-gradients received, counted in contributions),
    ``pending`` (those since the last momentum update), ``delta`` (their sum; absent right after an update) and
    ``momentum_buffer`` (absent before the first).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        *,
        lr: float,
        momentum: float,
        delay: int,
        activation: float = 0.0,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"the outer lr must be >= 0, got {lr}")
        if not 0 < momentum < 1:
            raise ValueError(f"Delayed Nesterov needs a momentum in (0, 1), got {momentum}")
        if delay < 1:
            raise ValueError(f"the delay N must be >= 1, got {delay}")
        if not 0 <= activation <= 1 / delay:
            raise ValueError(
                f"the momentum activation c must be in [0, 1/N] = [0, {1 / delay:g}], got {activation}"
            )
        super().__init__(params, {"lr": lr, "momentum": momentum, "delay": delay, "activation": activation})

    @torch.no_grad()
    def step(self, closure: None = None, count: int = 1) -> None:  # type: ignore[override]
        """Apply each parameter's ``.grad``, the mean of ``count`` contributions, as the module docstring says."""
        if closure is not None:
            raise ValueError("DelayedNesterov takes pseudo-gradients set as .grad; it has no closure")
        if count < 1:
            raise ValueError(
                f"a pseudo-gradient is the mean of at least one contribution, got count = {count}"
            )
        for group in self.param_groups:
            lr, beta, n, c = group["lr"], group["momentum"], group["delay"], group["activation"]
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(param, param.grad, count, lr, beta, n, c)

    def _step_one(
        self, param: torch.Tensor, grad: torch.Tensor, k: int, lr: float, beta: float, n: int, c: float
    ) -> None:
        state = self.state[param]
        received = state.get("step", 0)
        state["step"] = received + k
        # a state saved before ``pending`` existed counted single pseudo-gradients: its block is step % N
        pending = state["pending"] = state.get("pending", received % n) + k
        if "delta" in state:
            state["delta"].add_(grad, alpha=k)
        else:
            state["delta"] = grad.mul(k)  # a copy (times 1 is exact)
        momentum = state.get("momentum_buffer")
        # The operations of torch's single-tensor SGD, in its order: with every k = N the result is its own.
        sent = grad if k == n else grad.div(n / k)
        if pending >= n:
            delta = state.pop("delta")
            mean = grad if pending == k == n else delta.div(pending)
            state["pending"] = 0
            if momentum is None:
                momentum = state["momentum_buffer"] = mean.clone()
            else:
                momentum.mul_(beta).add_(mean)
            update = sent.add(momentum, alpha=(1 - c * n + c) * beta)
        elif momentum is not None and c > 0:
            update = sent.add(momentum, alpha=c * beta)
        else:
            update = sent
        param.add_(update, alpha=-lr)


def outer_optimizer(
    params: Iterable[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    delay: int = 1,
    activation: float = 0.0,
) -> torch.optim.Optimizer:
    """The syncer's outer optimizer: lock-step's ``torch.optim.SGD`` for ``delay = 1``, else
    ``DelayedNesterov`` (which needs ``nesterov`` and a momentum).

    Raises:
        ValueError: ``delay > 1`` without Nesterov momentum, or a value the optimizer refuses.
    """
    if delay == 1:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)
    if not nesterov:
        raise ValueError(f"a delay of {delay} is Delayed Nesterov: it needs nesterov = true and a momentum")
    return DelayedNesterov(params, lr=lr, momentum=momentum, delay=delay, activation=activation)


def state_bytes(optimizer: torch.optim.Optimizer) -> bytes:
    """The optimizer's ``state_dict`` as one safetensors file: tensors as tensors, the rest as JSON."""
    skeleton, tensors = flatten(optimizer.state_dict())
    return safetensors.torch.save(tensors, metadata={_STATE: json.dumps(skeleton)})


def load_state_bytes(optimizer: torch.optim.Optimizer, data: bytes) -> None:
    """Load what ``state_bytes`` wrote into ``optimizer`` (built over the same parameters).

    Raises:
        CheckpointError: ``data`` is not such a file.
    """
    try:
        header, _ = read_header(data)
        skeleton = json.loads(header["__metadata__"][_STATE])  # type: ignore[index]
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error type for every malformed layout
        raise CheckpointError(f"not an outer optimizer's state: {e}") from e
    optimizer.load_state_dict(unflatten(skeleton, tensors))
