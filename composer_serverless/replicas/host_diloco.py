"""torchft's DiLoCo with its outer state in host memory: the sync adds nothing to the accelerator.

torchft 0.2.0 keeps the global copy of the weights in (pinned) host memory, but computes everything else of a
sync on the parameters' device: the pseudo-gradient (``original.to(device) - local``, one device tensor per
parameter plus a device copy of the global one), the flat bucket it packs them into, a clone of the local
weights (made even when ``fragment_update_alpha`` is 0 and the merge needs none), and the outer optimizer's
step with its momentum beside the weights. On one H100 that took a full fine-tune from 20 bytes per parameter
in the inner step to 29 at the sync (issue 29). INTELLECT-1 (``zeroband/diloco.py``) keeps all of it on the
CPU; so does this.

``HostFragment`` is torchft's ``_StreamingDiLoCoFragment`` with four methods replaced, each because its
torchft version works on the device:

* ``_save_grads``: the local weights are copied (asynchronously, one wait) into one flat host buffer, shared
  by the fragments (one sync runs at a time), and the pseudo-gradient ``global - local`` is computed there in
  place: the buffer is the bucket the manager averages, and each parameter's pseudo-gradient a view of it.
* ``_average_grads``: hands that buffer to the manager as is (torchft's packs device tensors into a new
  device bucket and unpacks the average from it through a future callback).
* ``_set_grads``: the averaged pseudo-gradient becomes the gradient of the host copy, not of the parameter.
* ``perform_sync``: the outer optimizer steps the host copy, which is then copied into the parameters once;
  torchft restores the parameters from the host copy, steps them on the device and copies them back. The
  local weights are cloned for the merge only when ``fragment_update_alpha`` > 0. With error feedback kept in
  the local weights (``diloco.error_feedback = "reset"``, the sparse codec) they restart from the global ones
  minus the replica's residual (``offset_local``): what its inputs have not sent yet stays in its own
  weights, so the next pseudo-gradient carries it again and the replica trains on from its own progress
  (CSER's error reset, Xie et al. 2020).

The outer optimizer therefore holds the host copy's tensors, not the model's: ``HostDiLoCo`` builds one per
fragment with the factory it is given. torchft's ``DiLoCo`` constructor names its fragment class, so
``HostDiLoCo`` lets it build torchft's fragments (their host copies allocated and filled as torchft does) and
adopts each one. Everything else (the schedule of syncs, overlap, the alpha merge, the registered state) is
torchft's, and a run is bit for bit the same as one with torchft's unmodified ``DiLoCo`` on CPU
(tests/replicas/test_host_diloco.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchft.local_sgd import DiLoCo, _StreamingDiLoCoFragment

from composer_serverless.accelerator.device import synchronize

OuterFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


@torch.no_grad()
def offset_local(fragment: nn.Module, residual: torch.Tensor) -> None:
    """Subtract ``residual`` (host memory, in the fragment's bucket order: its parameters' local values in
    ``named_parameters`` order) from the fragment's parameters: the local weights become the global ones
    minus what this replica has not sent yet."""
    offset = 0
    for _, param in fragment.named_parameters():
        local = _local(param.data)
        part = residual[offset : offset + local.numel()].view_as(local)
        local.sub_(part.to(device=local.device, dtype=local.dtype))
        offset += local.numel()
    if offset != residual.numel():
        raise ValueError(f"a residual of {residual.numel()} values for a fragment of {offset}")


class HostFragment(_StreamingDiLoCoFragment):
    """One Streaming DiLoCo fragment whose pseudo-gradient, average and outer step live in host memory."""

    _bucket: torch.Tensor
    _index: int

    @classmethod
    def adopt(
        cls, fragment: _StreamingDiLoCoFragment, outer: OuterFactory, bucket: torch.Tensor, index: int
    ) -> HostFragment:
        """``fragment`` (the ``index``-th) as a HostFragment: its state (host copy included) taken over as
        torchft built it, an outer optimizer over the host copy, and ``bucket`` (host memory, at least the
        fragment's size) to compute its pseudo-gradient in."""
        host = cls.__new__(cls)
        host.__dict__.update(vars(fragment))
        host._index = index
        host._outer_optimizer = outer(host.original_parameters.values())
        dtype = next(iter(host.original_parameters.values())).dtype  # torchft's bucket: the first tensor's
        size = sum(t.numel() for t in host.original_parameters.values())
        host._bucket = bucket.view(dtype)[:size] if bucket.dtype != dtype else bucket[:size]
        host.register_state_dict_fn()  # torchft's load and save functions, bound to this object
        return host

    @torch.no_grad()
    def _save_grads(self) -> None:
        params = dict(self._model_fragment.named_parameters())
        views, offset = {}, 0
        for name, original in self.original_parameters.items():
            views[name] = self._bucket[offset : offset + original.numel()].view_as(original)
            offset += original.numel()
        device = next(iter(params.values())).device
        staged = {}
        for name, view in views.items():
            local = _local(params[name].data)
            # Straight into the bucket when the dtypes agree; else torchft's arithmetic in the parameter's
            # dtype first (a rare mixed fragment: a float32 router behind bfloat16 weights).
            target = view if view.dtype == local.dtype else torch.empty_like(self.original_parameters[name])
            target.copy_(local, non_blocking=True)
            staged[name] = target
        synchronize(device)  # one wait for every copy, not one per parameter
        for name, view in views.items():
            original, local = self.original_parameters[name], staged[name]
            if local is view:
                torch.sub(original, view, out=view)  # global - local, as torchft computes it
            else:
                view.copy_(original - local)
            self._grads[name] = view

    def _average_grads(self) -> None:
        self._allreduce_work.append(
            self._manager.allreduce(self._bucket, should_quantize=self.should_quantize)
        )

    def _set_grads(self) -> None:
        for name, original in self.original_parameters.items():
            grad = self._grads.pop(name)
            # In a mixed fragment, rounded to the parameter's dtype as torchft's unpacking of the bucket does.
            original.grad = grad if grad.dtype == original.dtype else grad.to(original.dtype)

    def perform_sync(self) -> bool:
        assert self._allreduce_work, "perform_sync before prepare_sync"
        for work in self._allreduce_work:
            work.wait()
        self._allreduce_work = []
        merge = self._fragment_update_alpha > 0
        if merge:
            self._save_local_parameters()
        committed = self._manager.should_commit()
        if committed:
            self._set_grads()
            self._outer_optimizer.step()
        self._outer_optimizer.zero_grad()
        self._grads.clear()
        self.restore_parameters()  # the new global parameters if committed, else the last ones
        feedback = getattr(self._manager, "feedback", None)
        if feedback is not None and feedback.reset and self._index in feedback.residuals:
            offset_local(self._model_fragment, feedback.residuals[self._index].inputs)
        if committed and merge:
            self._merge_parameters()
        self._clear_local_parameters()
        return committed


class HostDiLoCo(DiLoCo):
    """torchft's ``DiLoCo`` over ``HostFragment``s (see the module).

    Args:
        outer: builds a fragment's outer optimizer over the tensors it is given (the fragment's host copy).
        the rest: as torchft's ``DiLoCo``; its backups are in host memory (``backup_device`` is not taken),
            pinned where an accelerator is present.
    """

    def __init__(
        self,
        manager: object,
        model_fragments: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        outer: OuterFactory,
        **kwargs: object,
    ) -> None:
        # torchft wants one outer optimizer per fragment before the host copy it will step exists. These are
        # built on the fragments' parameters and replaced unused: an optimizer allocates no state before its
        # first step.
        super().__init__(
            manager,  # type: ignore[arg-type]
            model_fragments,
            inner_optimizer,
            [outer(f.parameters()) for f in model_fragments],
            **kwargs,  # type: ignore[arg-type]
        )
        # Every element of a fragment at its first tensor's width, as torchft packs a bucket. The shared
        # buffer is allocated in units of the widest of those widths, so each fragment's view of it at its
        # own dtype is whole: a bf16 fragment of an odd number of elements as the largest would otherwise
        # leave a byte count that a float32 fragment cannot view.
        widths = [next(iter(f.original_parameters.values())).element_size() for f in self._fragments]
        sizes = [
            sum(t.numel() for t in f.original_parameters.values()) * width
            for f, width in zip(self._fragments, widths, strict=True)
        ]
        unit = max(widths)
        bucket = torch.empty(
            -(-max(sizes) // unit) * unit, dtype=torch.uint8, pin_memory=torch.accelerator.is_available()
        )
        self._fragments = [HostFragment.adopt(f, outer, bucket, i) for i, f in enumerate(self._fragments)]
