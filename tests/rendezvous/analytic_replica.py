"""One replica of torchft's mocked DiLoCo trajectory (diloco_regression_test.py) through ObjectStoreManager.

    python analytic_replica.py --store URL [URL ...] --rank R --out history.json

For each store, runs every case of fragments in {1, 2} x fragment_sync_delay in {0, 1} x alpha in {0, 0.5} x
torchft's own ``DiLoCo`` and ours with the outer state in host memory (``HostDiLoCo``), each under its own
prefix, and writes each case's parameter history (after every inner step) as JSON, keyed by store URL then
case. One process covers all stores: starting a replica (importing torch) costs more than all of its syncs.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from composer_serverless.rendezvous.allreduce import ExchangeSettings
from composer_serverless.rendezvous.deadline import GraceSettings
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.replicas.host_diloco import HostDiLoCo

CASES = [
    (fragments, delay, alpha, host)
    for fragments in (1, 2)
    for delay in (0, 1)
    for alpha in (0.0, 0.5)
    for host in (False, True)
]
SYNC_EVERY = 6
SYNCS = 4


class MockOptimizer(torch.optim.Optimizer):
    """torchft's: p -= lr * grad."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def case_key(fragments: int, delay: int, alpha: float, host: bool) -> str:
    return f"f{fragments}-d{delay}-a{alpha}" + ("-host" if host else "")


def run_case(url: str, rank: int, fragments: int, delay: int, alpha: float, host: bool) -> list[list[float]]:
    layers = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(fragments))
    for layer in layers:
        nn.init.ones_(layer.weight)
    inner = MockOptimizer(layers.parameters(), lr=1.0)
    manager = ObjectStoreManager(
        ObjectStore(url).child(case_key(fragments, delay, alpha, host).replace(".", "_")),
        run_id="analytic",
        rank=rank,
        fragments=fragments,
        settings=ExchangeSettings(replicas=2, min_replicas=2, codec="fp32", timeout_s=120),
        grace=GraceSettings(min_s=0.0, max_s=60.0, mads=4.0),
    )
    history = [[layer.weight.item() for layer in layers]]
    settings = {"sync_every": SYNC_EVERY, "fragment_sync_delay": delay, "fragment_update_alpha": alpha}
    if host:
        diloco = HostDiLoCo(manager, list(layers), inner, lambda ps: MockOptimizer(ps, lr=2.0), **settings)
    else:
        outer = [MockOptimizer(layer.parameters(), lr=2.0) for layer in layers]
        diloco = DiLoCo(
            manager, list(layers), inner, outer, use_bucketization=True, bucket_cap_mb=1, **settings
        )
    with diloco:
        while manager.current_step() < SYNCS:
            for layer in layers:
                layer.weight.grad = torch.full_like(layer.weight, 2.0)
            inner.step()
            history.append([layer.weight.item() for layer in layers])
            if manager.last_sync is not None and not manager.last_sync.committed:
                raise RuntimeError(f"sync failed: {manager.last_sync.error}")
    return history


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True, nargs="+")
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    histories = {
        url: {case_key(*case): run_case(url, args.rank, *case) for case in CASES} for url in args.store
    }
    with open(args.out, "w") as f:
        json.dump(histories, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
