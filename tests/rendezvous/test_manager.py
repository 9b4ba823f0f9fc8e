"""ObjectStoreManager: the torchft Manager duck type. The analytic DiLoCo trajectory with 2 replica
processes over file:// and S3 (torchft's DiLoCo and ours with host-resident outer state), and the Work/commit
contract in-process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from analytic_replica import CASES, SYNC_EVERY, case_key
from faults import InjectedFault
from harness import HERE, subprocess_env, wait_all

from composer_serverless.accelerator.simulated import simulated
from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.allreduce import ExchangeSettings, StaleRoundError
from composer_serverless.rendezvous.deadline import GraceSettings
from composer_serverless.rendezvous.feedback import ErrorFeedback
from composer_serverless.rendezvous.manager import ObjectStoreManager
from composer_serverless.rendezvous.retry import RetryPolicy
from composer_serverless.rendezvous.sparse import Sparse
from composer_serverless.rendezvous.store import ObjectStore


def analytic_history(fragments: int, delay: int, alpha: float, steps: int) -> list[list[float]]:
    """torchft's mocked DiLoCo in closed form, 2 identical replicas: every inner step p -= 2; at a fragment's
    prepare step its pseudo-gradient is global - local; at its sync step the global becomes
    global - 2 * pseudo-gradient (outer lr 2; the average of two equal pseudo-gradients is that one) and the
    fragment's parameters become lerp(new global, local, alpha)."""
    per_fragment = SYNC_EVERY // fragments
    params = [1.0] * fragments
    global_ = [1.0] * fragments
    local_step = manager_step = 0
    pending: tuple[int, float] | None = None
    history = [list(params)]
    for _ in range(steps):
        params = [p - 2 for p in params]
        local_step += 1
        if local_step == per_fragment - delay:
            fragment = manager_step % fragments
            pending = (fragment, global_[fragment] - params[fragment])
        if local_step == per_fragment:
            assert pending is not None
            fragment, delta = pending
            global_[fragment] -= 2 * delta
            params[fragment] = global_[fragment] + alpha * (params[fragment] - global_[fragment])
            manager_step += 1
            local_step = 0
        history.append(list(params))
    return history


@pytest.mark.slow
def test_torchft_analytic_trajectory_with_two_replica_processes(tmp_path: Path, s3_url: str) -> None:
    urls = [f"file://{tmp_path}/run", s3_url]
    outs = [tmp_path / f"history-{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "analytic_replica.py"),
                "--store",
                *urls,
                "--rank",
                str(r),
                "--out",
                str(outs[r]),
            ],
            env=subprocess_env(),
            cwd=HERE,
        )
        for r in range(2)
    ]
    assert wait_all(procs) == [0, 0]
    histories = [json.loads(out.read_text()) for out in outs]
    for url in urls:
        for case in CASES:
            key = case_key(*case)
            expected = analytic_history(*case[:3], steps=len(histories[0][url][key]) - 1)
            assert histories[0][url][key] == expected, (url, key)
            assert histories[1][url][key] == expected, (url, key)


class GatedStore(ObjectStore):
    """Holds every backend call until ``gate`` is set."""

    def __init__(self, url: str, gate: threading.Event) -> None:
        super().__init__(url)
        self.gate = gate

    def _attempt(self, op, key, fn):
        assert self.gate.wait(timeout=60)
        return fn()


def manager_for(store: ObjectStore, codec: str = "fp32") -> ObjectStoreManager:
    return ObjectStoreManager(
        store,
        run_id="r",
        rank=0,
        fragments=1,
        settings=ExchangeSettings(replicas=1, min_replicas=1, codec=codec, timeout_s=30),
        grace=GraceSettings(min_s=0.0, max_s=5.0, mads=4.0),
    )


def test_allreduce_runs_behind_the_caller_and_fills_the_tensor_before_the_future(tmp_path: Path) -> None:
    gate = threading.Event()
    manager = manager_for(GatedStore(f"file://{tmp_path}/run", gate), codec="bf16")
    manager.start_quorum()
    tensor = torch.full((5,), 1 / 3)
    work = manager.allreduce(tensor)
    # The exchange is held at the store: allreduce has returned and the future is still pending.
    assert not work.get_future().done()
    seen: list[torch.Tensor] = []
    chained = work.get_future().then(lambda _: seen.append(tensor.clone()))
    gate.set()
    assert work.wait()
    chained.wait()
    # With one replica the average is its own input through the bf16 codec, in place before the callback.
    assert torch.equal(seen[0], torch.full((5,), 1 / 3).to(torch.bfloat16).float())
    assert manager.should_commit() and manager.current_step() == 1
    assert manager.last_sync.participants == [0]


def test_a_failed_exchange_does_not_commit_or_advance(tmp_path: Path) -> None:
    class Broken(ObjectStore):
        def _attempt(self, op, key, fn):
            if key.startswith("rounds/") or key.startswith("in/") or key == "quorum.json":
                raise InjectedFault("down")
            return fn()

    manager = manager_for(Broken(f"file://{tmp_path}/run", retry=RetryPolicy(attempts=2, first_s=0.001)))
    manager.start_quorum()
    tensor = torch.ones(3)
    work = manager.allreduce(tensor)
    work.wait()
    assert work.get_future().done()
    assert not manager.should_commit()
    assert manager.current_step() == 0 and manager.syncs_attempted == 1
    assert manager.last_sync.error is not None and not manager.last_sync.committed


def test_a_replica_behind_the_store_does_not_reopen_a_completed_round(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/run")
    store.put(layout.LATEST, json.dumps({"round": 1}).encode())
    manager = manager_for(store)
    manager.start_quorum()
    manager.allreduce(torch.ones(3)).wait()
    assert not manager.should_commit()
    assert isinstance(manager.last_sync.error, StaleRoundError)
    assert "quorum.json" not in store.list_tree("rounds/1/0")


def test_a_second_allreduce_in_one_sync_fails_the_sync(tmp_path: Path) -> None:
    manager = manager_for(ObjectStore(f"file://{tmp_path}/run"))
    manager.start_quorum()
    manager.allreduce(torch.ones(3)).wait()
    manager.allreduce(torch.ones(3)).wait()
    assert not manager.should_commit()
    assert "bucket" in str(manager.last_sync.error)


def test_on_an_accelerator_the_exchange_thread_touches_host_memory_only(tmp_path: Path) -> None:
    """The bucket is copied to pinned host memory without blocking the caller; the exchange thread waits for
    that copy and works on host memory; the average lands in the bucket, and torchft's callback runs, on the
    caller's thread when it waits for the Work (counted by the simulated accelerator, which raises on a host
    read of a copy still in flight)."""
    gate = threading.Event()
    with simulated() as sim:
        manager = manager_for(GatedStore(f"file://{tmp_path}/run", gate), codec="bf16")
        manager.start_quorum()
        tensor = torch.full((5,), 1 / 3, device="cuda")
        work = manager.allreduce(tensor)
        seen: list[tuple[str, torch.Tensor]] = []
        chained = work.get_future().then(
            lambda _: seen.append((threading.current_thread().name, tensor.cpu()))
        )
        gate.set()
        assert work.wait()
        chained.wait()
        assert manager.should_commit(), manager.last_sync.error
    assert seen[0][0] == "MainThread"
    assert torch.equal(seen[0][1], torch.full((5,), 1 / 3).to(torch.bfloat16).float())
    assert [name for name in sim.device_kernels if name.startswith("exchange-")] == []
    assert sim.device_kernels["MainThread"] > 0


def test_error_feedback_keeps_the_residual_of_a_committed_sync_only(tmp_path: Path) -> None:
    """A sync that commits with this replica's inputs averaged keeps the new residual, the pseudo-gradient
    minus what was sent (from a tensor on the simulated accelerator: the residual stays in host memory); a
    failed one leaves the residual as it was."""
    codec = Sparse(density=0.25, chunk=8)
    feedback = ErrorFeedback()
    manager = ObjectStoreManager(
        ObjectStore(f"file://{tmp_path}/run"),
        run_id="r",
        rank=0,
        fragments=1,
        settings=ExchangeSettings(replicas=1, min_replicas=1, codec=codec, timeout_s=30),
        grace=GraceSettings(min_s=0.0, max_s=5.0, mads=4.0),
        feedback=feedback,
    )
    delta = torch.tensor([4.0, 1.0, -2.0, 0.5, 0.0, 0.0, 3.0, -0.25])
    with simulated():
        manager.start_quorum()
        bucket = delta.to("cuda")
        manager.allreduce(bucket).wait()
        assert manager.should_commit(), manager.last_sync.error
        # k = 2: 4 and 3 are sent (each half one value, so exactly), the rest waits in the residual.
        assert torch.equal(bucket.cpu(), torch.tensor([4.0, 0, 0, 0, 0, 0, 3.0, 0]))
    residual = torch.tensor([0.0, 1.0, -2.0, 0.5, 0.0, 0.0, 0.0, -0.25])
    # What it carried of the pseudo-gradient's squared norm: (16 + 9) / 30.3125.
    assert (manager.carried_syncs, manager.carried_total) == (1, pytest.approx(25 / 30.3125))
    kept = feedback.residual(0, 8, 8)
    assert kept.inputs.device.type == "cpu"
    assert torch.equal(kept.inputs, residual)
    assert not kept.owned.any()  # the average it published, of what it sent, is exactly sparse

    # Round 2 completed without this replica (the store says so): its sync fails as stale.
    ObjectStore(f"file://{tmp_path}/run").put(layout.LATEST, json.dumps({"round": 2}).encode())
    manager.start_quorum()
    manager.allreduce(delta.clone()).wait()
    assert not manager.should_commit()
    assert torch.equal(feedback.residual(0, 8, 8).inputs, residual)  # a failed sync moved nothing
    assert manager.carried_syncs == 1  # and counts for nothing


def test_error_feedback_moves_the_residual_of_the_shards_that_averaged_the_input(tmp_path: Path) -> None:
    """Two replicas, a fragment of 16 values in two shards of 8; replica 0's input of shard 1 is unreadable
    (an earlier attempt stored garbage there), so shard 1's average leaves it out and shard 0's holds it. The
    sync commits; replica 0's residual takes what its input of shard 0 left out (k = 2 of each chunk of 8:
    4 and 3 sent exactly) and keeps its old residual (zeros) in shard 1."""
    codec = Sparse(density=0.25, chunk=8)
    url = f"file://{tmp_path}/run"
    ObjectStore(url).child(layout.sync(1, 0)).create(layout.sync_input(0, 1), b"not a payload")
    feedbacks = {rank: ErrorFeedback() for rank in (0, 1)}
    deltas = {
        0: torch.tensor([4.0, 1.0, -2.0, 0.5, 0.0, 0.0, 3.0, -0.25] * 2),
        1: torch.arange(16.0),
    }
    committed = {}

    def replica(rank: int) -> None:
        manager = ObjectStoreManager(
            ObjectStore(url),
            run_id="r",
            rank=rank,
            fragments=1,
            settings=ExchangeSettings(replicas=2, min_replicas=2, codec=codec, timeout_s=30),
            grace=GraceSettings(min_s=0.0, max_s=5.0, mads=4.0),
            feedback=feedbacks[rank],
        )
        manager.start_quorum()
        manager.allreduce(deltas[rank].clone()).wait()
        committed[rank] = (manager.should_commit(), manager.last_sync)

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert committed[0][0] and committed[0][1].rejected == [0], committed
    left = torch.tensor([0.0, 1.0, -2.0, 0.5, 0.0, 0.0, 0.0, -0.25])
    assert torch.equal(feedbacks[0].residual(0, 16, 8).inputs, torch.cat([left, torch.zeros(8)]))


def test_an_outlier_is_left_out_of_every_shard_and_keeps_its_whole_residual(tmp_path: Path) -> None:
    """Four replicas whose pseudo-gradients have norms 1, 2, 3 and 7 (x 8), factor 3: the lower median is 2 and
    replica 3 (7 > 6) is an outlier. Replica 0's input of shard 1 is unreadable, so shard 1's owner reads 2, 3
    and 7 only, whose median (3) would keep replica 3 there. The sync commits everywhere without replica 3 in
    any shard: its residual of error feedback stays whole as it was, in every shard, as if it had sent nothing
    (as a replica that died would); an honest replica's moves in every shard its input was averaged in."""
    numel, shard = 64, 16
    codec = Sparse(density=0.25, chunk=8)
    url = f"file://{tmp_path}/run"
    ObjectStore(url).child(layout.sync(1, 0)).create(layout.sync_input(0, 1), b"not a payload")
    deltas = {}
    before = {}
    feedbacks = {}
    for rank, scale in enumerate((1.0, 2.0, 3.0, 7.0)):
        noise = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        deltas[rank] = noise / noise.norm() * 8 * scale
        before[rank] = torch.randn(numel, generator=torch.Generator().manual_seed(10 + rank)) * 1e-3
        feedbacks[rank] = ErrorFeedback()
        feedbacks[rank].load_state_dict({"0/inputs": before[rank].clone(), "0/owned": torch.zeros(shard)})
    outcomes = {}

    def replica(rank: int) -> None:
        manager = ObjectStoreManager(
            ObjectStore(url),
            run_id="r",
            rank=rank,
            fragments=1,
            settings=ExchangeSettings(4, 4, codec, 30, outlier_factor=3.0),
            grace=GraceSettings(min_s=0.0, max_s=5.0, mads=4.0),
            feedback=feedbacks[rank],
        )
        manager.start_quorum()
        manager.allreduce(deltas[rank].clone()).wait()
        outcomes[rank] = (manager.should_commit(), manager.last_sync)

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for committed, outcome in outcomes.values():
        assert committed and outcome.rejected == [0, 3], outcome
    assert torch.equal(feedbacks[3].residual(0, numel, shard).inputs, before[3])
    for rank in (0, 1, 2):
        after = feedbacks[rank].residual(0, numel, shard).inputs
        for s in range(4):
            span = slice(s * shard, (s + 1) * shard)
            kept = rank == 0 and s == 1  # the shard that could not read its input
            assert torch.equal(after[span], before[rank][span]) == kept, (rank, s)
