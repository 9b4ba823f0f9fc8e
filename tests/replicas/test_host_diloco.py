"""``HostDiLoCo`` (the outer state in host memory) against torchft's unmodified ``DiLoCo`` as the oracle: the
same weights and outer momentum, bit for bit, through the real store exchange; and on the simulated device,
a sync that allocates nothing on the accelerator."""

from __future__ import annotations

import math
import uuid

import pytest
import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.config import validate_config
from composer_serverless.rendezvous.allreduce import ExchangeSettings
from composer_serverless.rendezvous.feedback import ErrorFeedback
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.sparse import Sparse
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.diloco import (
    grace_settings,
    make_diloco,
    make_inner_optimizer,
    outer_optimizer,
    split_fragments,
)
from tests.test_equivalence import batches, in_threads, tiny_llama


def _config(fragments: int, delay: int, alpha: float):
    return validate_config(
        {
            "model": {"tiny": {}},
            "train": {"optimizer": "adamw", "lr": 0.02, "schedule": "constant", "grad_clip": None},
            "diloco": {
                "replicas": 2,
                "sync_every": 4,
                "rounds": 3,
                "outer_lr": 0.7,
                "outer_momentum": 0.9,
                "nesterov": True,
                "fragments": fragments,
                "fragment_sync_delay": delay,
                "fragment_update_alpha": alpha,
            },
        }
    )


def torchft_diloco(manager, fragments, inner, dl) -> DiLoCo:
    """torchft's DiLoCo as it comes, its outer SGD over the model's parameters, one bucket per fragment."""
    largest = max(sum(p.numel() * p.element_size() for p in f.parameters()) for f in fragments)
    return DiLoCo(
        manager,
        fragments,
        inner,
        [outer_optimizer(dl)(f.parameters()) for f in fragments],
        sync_every=dl.sync_every,
        use_bucketization=True,
        bucket_cap_mb=math.ceil(largest / 2**20),
        fragment_sync_delay=dl.fragment_sync_delay,
        fragment_update_alpha=dl.fragment_update_alpha,
    )


class FailingManager(ObjectStoreManager):
    """Fails the exchange of the syncs numbered in ``fail`` (counted from 0 over attempts)."""

    def __init__(self, *args, fail=(), **kwargs):
        super().__init__(*args, **kwargs)
        self._fail = set(fail)
        self._attempt = 0

    def _exchange(self, staged, copied, outcome, rows=None, residual=None, sync=None):
        attempt, self._attempt = self._attempt, self._attempt + 1
        if attempt in self._fail:
            outcome.error = RuntimeError("injected")
            return
        super()._exchange(staged, copied, outcome, rows, residual, sync)


def one_replica(dl, codec, feedback: ErrorFeedback | None = None, fragments: int = 1) -> ObjectStoreManager:
    """The manager of a run of one replica and ``fragments`` fragments, in a fresh in-memory store."""
    return ObjectStoreManager(
        ObjectStore(f"memory://host-diloco-{uuid.uuid4().hex}"),
        run_id="host",
        rank=0,
        fragments=fragments,
        settings=ExchangeSettings(replicas=1, min_replicas=1, codec=codec, timeout_s=60),
        grace=grace_settings(dl),
        feedback=feedback,
    )


def mixed_dtypes(model):
    """bf16 decoder layers, a float32 final norm and head: the fragment's bucket is float32 (its widest dtype
    first) and carries bf16 pseudo-gradients."""
    model.to(torch.bfloat16)
    model.model.norm.float()
    model.lm_head.float()
    return model


def run(build, config, *, fail=(), prepare=lambda model: model):
    """Train both replicas in threads; return each one's parameters and outer optimizer states."""
    url = f"memory://host-diloco-{uuid.uuid4().hex}"
    dl = config.diloco
    models = {rank: prepare(tiny_llama()) for rank in range(dl.replicas)}
    out: dict[int, tuple[dict, list]] = {}

    def replica(rank: int) -> None:
        model = models[rank]
        inner = make_inner_optimizer(model, config.train)
        fragments = split_fragments(model, dl.fragments)
        manager = FailingManager(
            ObjectStore(url),
            run_id="host",
            rank=rank,
            fragments=dl.fragments,
            settings=ExchangeSettings(replicas=2, min_replicas=2, codec="fp32", timeout_s=60),
            grace=grace_settings(dl),
            fail=fail,
        )
        data = iter(batches(rank, 64))
        with build(manager, fragments, inner, dl) as diloco:
            while manager.current_step() < dl.rounds * dl.fragments:
                batch = next(data)
                model(input_ids=batch, labels=batch).loss.backward()
                inner.step()
                inner.zero_grad()
        outer = [f._outer_optimizer.state_dict() for f in diloco._fragments]
        out[rank] = ({n: p.detach().clone() for n, p in model.named_parameters()}, outer)

    in_threads(replica, dl.replicas)
    return out


def assert_same(actual, expected) -> None:
    for rank in expected:
        (params, outer), (want_params, want_outer) = actual[rank], expected[rank]
        assert params.keys() == want_params.keys()
        for name in want_params:
            assert torch.equal(params[name], want_params[name]), (rank, name)
        for mine, theirs in zip(outer, want_outer, strict=True):
            assert mine["state"].keys() == theirs["state"].keys() and mine["state"]
            for index, state in theirs["state"].items():
                assert torch.equal(mine["state"][index]["momentum_buffer"], state["momentum_buffer"])


@pytest.mark.parametrize(
    ("fragments", "delay", "alpha"),
    [(1, 0, 0.0), (2, 1, 0.0), (2, 0, 0.5)],
    ids=["plain", "overlap", "merge"],
)
def test_host_outer_state_is_bit_identical_to_torchft(fragments, delay, alpha) -> None:
    config = _config(fragments, delay, alpha)
    expected = run(torchft_diloco, config)
    actual = run(make_diloco, config)
    assert_same(actual, expected)
    # The replicas really moved apart between syncs and together at them: not a run that did nothing.
    assert not torch.equal(actual[0][0]["model.norm.weight"], tiny_llama().model.norm.weight.detach())


def test_a_fragment_of_mixed_dtypes_is_bit_identical_to_torchft() -> None:
    """bf16 pseudo-gradients computed in bf16, carried in a float32 bucket, rounded back for the outer step."""
    config = _config(1, 0, 0.0)
    expected = run(torchft_diloco, config, prepare=mixed_dtypes)
    actual = run(make_diloco, config, prepare=mixed_dtypes)
    assert_same(actual, expected)
    assert actual[0][0]["lm_head.weight"].dtype == torch.float32
    assert actual[0][0]["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_a_failed_sync_restores_the_same_global_weights_as_torchft() -> None:
    config = _config(2, 0, 0.0)
    expected = run(torchft_diloco, config, fail={1})
    actual = run(make_diloco, config, fail={1})
    assert_same(actual, expected)
    # The failure changed the trajectory (a discarded fragment sync): the oracle is not the plain run.
    plain = run(torchft_diloco, config)
    assert not all(torch.equal(plain[0][0][n], expected[0][0][n]) for n in plain[0][0])


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_a_sync_allocates_nothing_on_the_accelerator(alpha) -> None:
    """The fragment's pseudo-gradient, its average and the outer step live in host memory: the device's peak
    during a sync is what was live before it (plus the clone of the local weights that the alpha merge
    needs), and the outer state is host memory."""
    config = _config(1, 0, alpha)
    dl = config.diloco
    with simulated() as sim:
        model = tiny_llama().to("cuda")
        inner = make_inner_optimizer(model, config.train)
        fragments = split_fragments(model, 1)
        manager = one_replica(dl, "fp32")
        starts: list[int] = []

        def free_gradients(optimizer, args, kwargs) -> None:
            """As the replica does, before DiLoCo's hook (registered first); the sync's window opens here."""
            optimizer.zero_grad(set_to_none=True)
            starts.append(sim.live_bytes)
            sim.reset_peak()

        inner.register_step_post_hook(free_gradients)
        peaks: list[tuple[int, int]] = []
        with make_diloco(manager, fragments, inner, config.diloco) as diloco:
            for batch in batches(0, dl.sync_every * 2):
                batch = batch.to("cuda")
                model(input_ids=batch, labels=batch).loss.backward()
                inner.step()
                if manager.syncs_attempted > len(peaks):
                    peaks.append((starts[-1], sim.peak_bytes))
        fragment = diloco._fragments[0]
        momentum = [s["momentum_buffer"] for s in fragment._outer_optimizer.state.values()]
        assert momentum and not any(sim.on_device(t) for t in momentum)
        assert not any(sim.on_device(t) for t in fragment.original_parameters.values())
        assert all(sim.on_device(p) for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(peaks) == 2
    for before, peak in peaks:
        assert peak - before == (weights if alpha else 0), (before, peak, weights)


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "resend"])
def test_with_error_reset_the_local_weights_restart_from_global_minus_the_residual(reset: bool) -> None:
    """With error reset, after a committed sync the local weights (on the simulated accelerator) are the new
    global ones minus what this replica's input left out, so the next pseudo-gradient carries that again;
    with resend (the default) they are the global ones."""
    config = _config(1, 0, 0.0)
    dl = config.diloco
    feedback = ErrorFeedback(reset=reset)
    with simulated():
        model = tiny_llama().to("cuda")
        inner = make_inner_optimizer(model, config.train)
        fragments = split_fragments(model, 1)
        manager = one_replica(dl, Sparse(), feedback)
        with make_diloco(manager, fragments, inner, dl) as diloco:
            for batch in batches(0, dl.sync_every):
                batch = batch.to("cuda")
                model(input_ids=batch, labels=batch).loss.backward()
                inner.step()
        assert manager.current_step() == 1
        local = [p.detach().cpu().reshape(-1) for p in fragments[0].parameters()]
        global_now = list(diloco._fragments[0].original_parameters.values())
        residual = feedback.residuals[0].inputs
        assert residual.device.type == "cpu" and float(residual.abs().sum()) > 0
        offset = 0
        for mine, glob in zip(local, global_now, strict=True):
            expected = (
                glob.reshape(-1) - residual[offset : offset + glob.numel()] if reset else glob.reshape(-1)
            )
            assert torch.equal(mine, expected)
            offset += glob.numel()
        assert offset == residual.numel()


def test_fragments_whose_largest_is_bf16_of_an_odd_size_share_one_bucket() -> None:
    """Fragment 0 is bf16 with 5 elements (10 bytes), fragment 1 float32 with 1 (4 bytes): the shared bucket
    must hold a whole float32 view as well as the bf16 one. Both fragments sync, and are torchft's bit for
    bit."""

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 1, bias=False).to(torch.bfloat16), nn.Linear(1, 1, bias=False))

    config = _config(2, 0, 0.0)
    dl = config.diloco
    results = []
    for factory in (torchft_diloco, make_diloco):
        model = build()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = one_replica(dl, "fp32", fragments=2)
        x = torch.ones(1, 5, dtype=torch.bfloat16)
        with factory(manager, [model[0], model[1]], inner, dl):
            while manager.current_step() < 2:
                model[1](model[0](x).float()).square().sum().backward()
                inner.step()
                inner.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert not torch.equal(results[1][1], build()[1].weight.detach()), "the float32 fragment synced"
