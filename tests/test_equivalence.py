"""Exact equivalences that pin the DiLoCo wiring: our manager under torchft's DiLoCo, replicas as threads.

- N=1, outer SGD lr 1, momentum 0: the outer step sets the global model to the local one, so the run equals
  plain training.
- N=2, H=1, inner SGD, outer SGD lr 1, momentum 0: the outer step applies the mean of lr * g_r, which is
  data-parallel SGD on the union batch.
- The same, averaging the embedding's and the head's rows over the replicas that trained them
  (``diloco.embedding_average = "touched"``): data-parallel SGD whose token rows take the mean gradient of the
  replicas whose batch held the token.
- The pseudo-gradient is global - local (a sign error once shipped in torchft, meta-pytorch/torchft#233).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from composer_serverless.config import validate_config
from composer_serverless.rendezvous.allreduce import ExchangeSettings
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.diloco import (
    grace_settings,
    make_diloco,
    make_inner_optimizer,
    make_schedule,
    split_fragments,
)
from composer_serverless.replicas.node import SOLO
from composer_serverless.replicas.touches import Touches

VOCAB, SEQ, BATCH = 50, 12, 3


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def batches(replica: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + replica)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def config(*, replicas, sync_every, rounds, optimizer, outer_lr=1.0, momentum=0.0, fragments=1):
    return validate_config(
        {
            "model": {"tiny": {}},
            "train": {"optimizer": optimizer, "lr": 0.05, "schedule": "constant", "grad_clip": None},
            "diloco": {
                "replicas": replicas,
                "sync_every": sync_every,
                "rounds": rounds,
                "outer_lr": outer_lr,
                "outer_momentum": momentum,
                "nesterov": momentum > 0,
                "fragments": fragments,
            },
        }
    )


class RecordingManager(ObjectStoreManager):
    """Records each tensor handed to allreduce (the flat pseudo-gradient), before it is averaged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[torch.Tensor] = []

    def allreduce(self, tensor, should_quantize=False):
        self.sent.append(tensor.detach().clone())
        return super().allreduce(tensor, should_quantize)


def run_diloco(cfg, steps_per_replica, *, touched=False):
    """Train every replica in its own thread through DiLoCo; return each replica's final parameters. With
    ``touched``, token rows are averaged over the replicas that trained them, as the trainer wires it."""
    store_url = f"memory://equivalence-{uuid.uuid4().hex}"
    results: dict[int, dict[str, torch.Tensor]] = {}
    managers: dict[int, RecordingManager] = {}

    # Built here, not in the threads: torch's global RNG is shared, so seeding inside threads would race.
    models = {rank: tiny_llama() for rank in range(cfg.diloco.replicas)}

    def replica(rank: int) -> None:
        model = models[rank]
        inner = make_inner_optimizer(model, cfg.train)
        schedule = make_schedule(inner, cfg.train, len(steps_per_replica[rank]))
        fragments = split_fragments(model, cfg.diloco.fragments)
        touches = Touches(model, fragments, SOLO, cfg.diloco.sync_every) if touched else None
        if touches:  # before DiLoCo's hook, as the trainer registers it
            inner.register_step_post_hook(lambda *_: touches.advance())
        # Every replica in every quorum: the equivalences are about the average of all of them.
        n = cfg.diloco.replicas
        manager = managers[rank] = RecordingManager(
            ObjectStore(store_url),
            run_id="eq",
            rank=rank,
            fragments=cfg.diloco.fragments,
            settings=ExchangeSettings(replicas=n, min_replicas=n, codec="fp32", timeout_s=60),
            grace=grace_settings(cfg.diloco),
            rows=touches.take if touches else None,
        )
        with make_diloco(manager, fragments, inner, cfg.diloco):
            for batch in steps_per_replica[rank]:
                model(input_ids=batch, labels=batch).loss.backward()
                inner.step()
                schedule.step()
                inner.zero_grad()
        results[rank] = {n: p.detach().clone() for n, p in model.named_parameters()}

    in_threads(replica, cfg.diloco.replicas)
    return results, managers


def in_threads(replica: Callable[[int], None], count: int) -> None:
    """``replica(rank)`` for every rank, each in its own thread; the first error is raised here."""
    errors: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            replica(rank)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(count)]
    torch.set_num_threads(1)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol=1e-6):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("fragments", [1, 2])
def test_one_replica_with_identity_outer_step_is_plain_training(fragments):
    # Inner SGD, not AdamW: the outer step leaves global - (global - local), which differs from local by an
    # ulp, and Adam's normalisation turns an ulp on a near-zero gradient into a full-size step (measured:
    # 3e-3 apart after 12 steps with AdamW, 7e-9 with SGD). That is Adam's sensitivity, not DiLoCo's.
    cfg = config(replicas=1, sync_every=4, rounds=3, optimizer="sgd", fragments=fragments)
    data = batches(0, 12)
    results, managers = run_diloco(cfg, {0: data})

    model = tiny_llama()
    inner = make_inner_optimizer(model, cfg.train)
    for batch in data:
        model(input_ids=batch, labels=batch).loss.backward()
        inner.step()
        inner.zero_grad()
    assert_close(results[0], {n: p.detach() for n, p in model.named_parameters()})
    # The outer step really ran: one nonzero pseudo-gradient per fragment and round went through the store.
    assert len(managers[0].sent) == 3 * fragments
    assert all(sent.abs().sum() > 0 for sent in managers[0].sent)


def test_two_replicas_h1_equal_data_parallel_sgd_on_the_union_batch():
    steps = 4
    cfg = config(replicas=2, sync_every=1, rounds=steps, optimizer="sgd")
    data = {r: batches(r, steps) for r in range(2)}
    results, _ = run_diloco(cfg, data)

    model = tiny_llama()
    sgd = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    for step in range(steps):
        # Equal batch sizes and lengths: the union batch's mean loss is the mean of the two means.
        union = sum(model(input_ids=data[r][step], labels=data[r][step]).loss for r in range(2)) / 2
        union.backward()
        sgd.step()
        sgd.zero_grad()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    assert_close(results[0], expected)
    # Every replica holds the same global model, bit for bit.
    assert all(torch.equal(results[0][n], results[1][n]) for n in expected)


def test_two_replicas_h1_average_each_token_row_over_the_replicas_whose_batch_held_it():
    steps = 3
    cfg = config(replicas=2, sync_every=1, rounds=steps, optimizer="sgd")
    data = {r: batches(r, steps) for r in range(2)}
    results, _ = run_diloco(cfg, data, touched=True)

    model = tiny_llama()
    token_rows = {"model.embed_tokens.weight", "lm_head.weight"}  # untied: both have a row per token
    singly_held = 0
    for step in range(steps):
        grads = []
        for r in range(2):
            model.zero_grad()
            model(input_ids=data[r][step], labels=data[r][step]).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        held = torch.stack([torch.bincount(data[r][step].reshape(-1), minlength=VOCAB) > 0 for r in range(2)])
        count = held.sum(0)
        singly_held += int((count == 1).sum())
        with torch.no_grad():
            for n, p in model.named_parameters():
                mean = (grads[0][n] + grads[1][n]) / 2
                if n in token_rows:
                    by_holders = (
                        grads[0][n] * held[0, :, None] + grads[1][n] * held[1, :, None]
                    ) / count.clamp(min=1)[:, None]
                    mean = torch.where((count > 0)[:, None], by_holders, mean)
                p -= cfg.train.lr * mean
    expected = {n: p.detach() for n, p in model.named_parameters()}
    assert_close(results[0], expected)
    assert all(torch.equal(results[0][n], results[1][n]) for n in expected)
    # Rows held by one replica's batch only: where this differs from the plain mean the test above checks.
    assert singly_held > 0


def test_pseudo_gradient_is_global_minus_local():
    lr, outer_lr = 0.05, 0.5
    cfg = config(replicas=1, sync_every=1, rounds=1, optimizer="sgd", outer_lr=outer_lr)
    batch = batches(0, 1)
    results, managers = run_diloco(cfg, {0: batch})

    model = tiny_llama()
    model(input_ids=batch[0], labels=batch[0]).loss.backward()
    grads = [p.grad.detach().reshape(-1) for p in model.parameters()]
    # One inner SGD step moves theta to theta - lr * g, so global - local = +lr * g (not -lr * g).
    (sent,) = managers[0].sent
    # atol: the subtraction global - local rounds to a few ulps of the norm weights (1.0).
    torch.testing.assert_close(sent, lr * torch.cat(grads), rtol=0, atol=2e-7)
    assert not torch.allclose(sent, -lr * torch.cat(grads), rtol=0, atol=1e-4)
    # Outer SGD then moves the global model half-way along -delta: theta - outer_lr * lr * g.
    expected = {n: p.detach() - outer_lr * lr * p.grad for n, p in model.named_parameters()}
    assert_close(results[0], expected)
