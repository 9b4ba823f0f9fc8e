"""The object-store all-reduce, with replicas as threads: exact averages, the bandwidth bound, quorums,
late replicas, dead shard owners and rejected payloads. Faults are injected by rule (a replica that never
runs, an input replaced by a pickle), never by timing."""

from __future__ import annotations

import json
import pickle
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from faults import FaultyStore

from composer_serverless.rendezvous import layout
from composer_serverless.rendezvous.allreduce import (
    MAX_QUORUM_GENERATIONS,
    ExchangeError,
    ExchangeResult,
    ExchangeSettings,
    allreduce,
)
from composer_serverless.rendezvous.codec import CODECS, NORM, decode, encode, l2_norm, read_header
from composer_serverless.rendezvous.deadline import GraceSettings, grace_s
from composer_serverless.rendezvous.feedback import Residuals
from composer_serverless.rendezvous.robust import outliers
from composer_serverless.rendezvous.rows import RowMask
from composer_serverless.rendezvous.runkey import RunKey
from composer_serverless.rendezvous.sharding import complete_ranks, shard_bounds, substitute_for
from composer_serverless.rendezvous.sparse import Sparse, compress, expand
from composer_serverless.rendezvous.store import ObjectStore
from composer_serverless.rendezvous.workspace import Workspace

PREFIX = "rounds/1/0"
IDENTITY = {"run_id": "run", "round": "1", "fragment": "0"}
NUMEL = 1001  # not a multiple of 3: shards of different sizes


def tensors(n: int, numel: int = NUMEL) -> dict[int, torch.Tensor]:
    return {r: torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)}


def _input(rank: int, shard: int) -> dict[str, str]:
    """The identity of replica ``rank``'s input of ``shard`` (local rank 0); every input also states its
    whole pseudo-gradient's norm (``NORM``)."""
    return {**IDENTITY, "local": "0", "rank": str(rank), "shard": str(shard)}


def exchange(
    url: str,
    values: dict[int, torch.Tensor],
    settings: ExchangeSettings,
    *,
    grace: float = 0.0,
    stores: dict[int, ObjectStore] | None = None,
    in_place: bool = False,
    workspaces: dict[int, Workspace] | None = None,
    prefix: str = PREFIX,
    rows: dict[int, RowMask] | None = None,
    residuals: dict[int, Residuals] | None = None,
) -> dict[int, ExchangeResult]:
    """Run the exchange of every rank in ``values`` concurrently, one thread and store instance each;
    ``in_place``: each writes the average over a copy of its values (``out=values``, as the manager does)."""
    results: dict[int, ExchangeResult] = {}
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            store = (stores or {}).get(rank) or ObjectStore(url)
            mine = values[rank].clone() if in_place else values[rank]
            results[rank] = allreduce(
                store,
                mine,
                prefix=prefix,
                identity=IDENTITY,
                rank=rank,
                settings=settings,
                grace_s=grace,
                out=mine if in_place else None,
                workspace=(workspaces or {}).get(rank),
                rows=(rows or {}).get(rank),
                residual=(residuals or {}).get(rank),
            )
            assert not in_place or results[rank].average.data_ptr() == mine.data_ptr()
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise next(iter(errors.values()))
    return results


def expected_average(
    values: dict[int, torch.Tensor], participants: list[int], codec: str, shards: int
) -> torch.Tensor:
    """What every replica must end with: per shard, the decoded inputs summed in rank order in fp32, divided
    by their number, then passed through the codec once more (the reduced shard is encoded too)."""
    numel = next(iter(values.values())).numel()
    out = torch.empty(numel)
    for start, end in shard_bounds(numel, shards):
        total = torch.zeros(end - start)
        for p in participants:
            total += decode(encode(values[p][start:end], {}, codec), {}, codec, end - start)
        out[start:end] = decode(encode(total / len(participants), {}, codec), {}, codec, end - start)
    return out


@pytest.fixture(params=["file", "memory", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/run"
    if request.param == "memory":
        return f"memory://run-{uuid.uuid4().hex[:8]}"
    return request.getfixturevalue("s3_url")


@pytest.mark.parametrize("codec", CODECS)
def test_every_replica_gets_the_same_exact_average(url: str, codec: str) -> None:
    values = tensors(3)
    settings = ExchangeSettings(replicas=3, min_replicas=3, codec=codec, timeout_s=60)
    # A long grace keeps a slow owner (a loaded machine) from being rescued; all 3 arrive anyway.
    results = exchange(url, values, settings, grace=10)
    expected = expected_average(values, [0, 1, 2], codec, 3)
    for result in results.values():
        assert result.participants == [0, 1, 2]
        assert torch.equal(result.average, expected)


def test_traffic_is_the_bandwidth_optimal_bound(tmp_path: Path) -> None:
    """Per replica: up = its N inputs + its reduced shard; down = N-1 peer inputs of its shard + N-1 reduced
    shards (+ the small quorum record): 2(N-1)/N of the wire size."""
    n = 4
    url = f"file://{tmp_path}/run"
    values = tensors(n, numel=40_000)
    results = exchange(
        url, values, ExchangeSettings(replicas=n, min_replicas=n, codec="fp32", timeout_s=60), grace=10
    )
    store = ObjectStore(url).child(PREFIX)
    size = store.size
    quorum = size("quorum.json")
    for r, result in results.items():
        wire = sum(size(layout.sync_input(r, s)) for s in range(n))
        assert result.bytes_up == wire + size(layout.sync_output(r))
        down = sum(size(layout.sync_input(p, r)) for p in range(n) if p != r) + sum(
            size(layout.sync_output(s)) for s in range(n) if s != r
        )
        # Replicas that did not fix the quorum also read its small record.
        assert result.bytes_down in (down, down + quorum)
        assert result.bytes_down <= 1.05 * 2 * (n - 1) / n * wire


@pytest.mark.parametrize("reduced", [None, "fp32"])
def test_sparse_inputs_with_their_residuals_average_alike_everywhere(
    tmp_path: Path, reduced: str | None
) -> None:
    """Each replica sends C(values + residual) and gets back its inputs' new residual, values + residual
    minus what it sent (replica 2's local weights hold its residual: it sends C(values)); each owner sums its
    shard's sparse inputs in rank order, adds its own residual to the average and publishes that
    re-sparsified, keeping what it left out (or, with ``reduced_codec`` fp32, publishes the average exactly);
    every replica ends with the same average, to the bit."""
    n, numel = 3, 30_001
    codec = Sparse(0.02)
    values = tensors(n, numel)
    bounds = shard_bounds(numel, n)

    def noise(seed: int, size: int) -> torch.Tensor:
        return torch.randn(size, generator=torch.Generator().manual_seed(seed))

    residuals = {
        r: Residuals(noise(10 + r, numel) if r < 2 else None, noise(20 + r, bounds[r][1] - bounds[r][0]))
        for r in range(n)
    }
    sending = {r: values[r] + residuals[r].inputs if r < 2 else values[r] for r in range(n)}
    settings = ExchangeSettings(
        replicas=n, min_replicas=n, codec=codec, timeout_s=60, reduced_codec=reduced or None
    )
    results = exchange(f"file://{tmp_path}/run", values, settings, grace=10, residuals=residuals)
    expected = torch.empty(numel)
    sent = {r: torch.empty(numel) for r in range(n)}
    owned = {}
    for s, (start, end) in enumerate(bounds):
        total = torch.zeros(end - start)
        for r in range(n):
            sent[r][start:end] = expand(compress(sending[r][start:end], codec), codec, end - start)
            total += sent[r][start:end]
        average = total / n + residuals[s].owned
        expected[start:end] = average if reduced else expand(compress(average, codec), codec, end - start)
        owned[s] = average - expected[start:end]
    for r, result in results.items():
        assert result.participants == [0, 1, 2]
        assert torch.equal(result.average, expected)
        assert result.residual is not None
        assert torch.equal(result.residual.inputs, sending[r] - sent[r])
        unsent = (sending[r] - sent[r]).double().square().sum() / sending[r].double().square().sum()
        assert result.carried == pytest.approx(1 - float(unsent), abs=1e-5)  # from fp32 norms
        assert torch.equal(result.residual.owned, owned[r])
        if reduced:
            assert not result.residual.owned.any()
    # The residuals passed in are not modified: the manager keeps them only once the sync commits.
    assert torch.equal(residuals[0].inputs, noise(10, numel))
    assert torch.equal(residuals[0].owned, noise(20, bounds[0][1] - bounds[0][0]))
    kept = sum(codec.entries(end - start) for start, end in bounds)
    assert int((expected != 0).sum()) <= (numel if reduced else kept)


def test_sparse_traffic_is_the_bound_of_its_own_size(tmp_path: Path) -> None:
    """With the average re-sparsified, every object of the sync is the sparse size, and the traffic per
    replica is the all-reduce bound of the sparse payload: 2(N-1)/N of its wire size down, about 140 times
    less than fp32's."""
    n, numel = 4, 400_000
    url = f"file://{tmp_path}/run"
    values = tensors(n, numel)
    settings = ExchangeSettings(replicas=n, min_replicas=n, codec=Sparse(), timeout_s=60)
    bounds = shard_bounds(numel, n)
    residuals = {r: Residuals(torch.zeros(numel), torch.zeros(bounds[r][1] - bounds[r][0])) for r in range(n)}
    results = exchange(url, values, settings, grace=10, residuals=residuals)
    size = ObjectStore(url).child(PREFIX).size
    for r, result in results.items():
        wire = sum(size(layout.sync_input(r, s)) for s in range(n))
        assert result.bytes_up == wire + size(layout.sync_output(r))
        assert result.bytes_down <= 1.05 * 2 * (n - 1) / n * wire
        assert 4 * numel / wire > 120


def test_quorum_forms_without_a_missing_replica_and_divides_by_the_participants(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/run"
    values = tensors(3)
    settings = ExchangeSettings(replicas=3, min_replicas=2, codec="fp32", timeout_s=60)
    results = exchange(url, {r: values[r] for r in (0, 1)}, settings, grace=0.05)
    expected = expected_average(values, [0, 1], "fp32", 3)
    for result in results.values():
        assert result.participants == [0, 1]
        assert torch.equal(result.average, expected)
    # Shard 2's owner is absent: the substitute named by the quorum reduced it.
    assert substitute_for(2, [0, 1]) == 0
    header, _ = read_header(ObjectStore(url).child(PREFIX).get(layout.sync_output(2)))
    assert header["__metadata__"]["summed"] == "0,1"

    # The late replica heals: it contributes nothing, uploads nothing, and gets the same average.
    late = exchange(url, {2: values[2]}, settings)[2]
    assert late.participants == [0, 1] and late.bytes_up == 0
    assert torch.equal(late.average, expected)
    assert not any(k.startswith("in/2-") for k in ObjectStore(url).child(PREFIX).list_tree())


def test_a_dead_shard_owner_does_not_stall_the_round(tmp_path: Path) -> None:
    """Replica 2 uploads its inputs (so it is in the quorum) and then dies before reducing its shard: the
    others reduce shard 2 after their deadline, and the result is the full average."""
    url = f"file://{tmp_path}/run"
    values = tensors(3)
    store = ObjectStore(url).child(PREFIX)
    for s, (start, end) in enumerate(shard_bounds(NUMEL, 3)):
        store.create(
            layout.sync_input(2, s),
            encode(values[2][start:end], {**_input(2, s), NORM: repr(l2_norm(values[2]))}, "int8"),
        )
    settings = ExchangeSettings(replicas=3, min_replicas=3, codec="int8", timeout_s=60)
    results = exchange(url, {0: values[0], 1: values[1]}, settings, grace=0.05)
    expected = expected_average(values, [0, 1, 2], "int8", 3)
    assert sum(len(r.rescued) for r in results.values()) >= 1
    for result in results.values():
        assert result.participants == [0, 1, 2]
        assert torch.equal(result.average, expected)


@pytest.mark.parametrize("codec", CODECS)
def test_the_average_can_overwrite_the_values_it_averages(tmp_path: Path, codec: str) -> None:
    """``out=values``: a shard of the values is overwritten only once this replica has read its own input
    of that shard, including as a substitute (replica 3 never comes) and as a rescuer (replica 2 uploads
    and dies), so the average is the one a fresh tensor gets."""
    url = f"file://{tmp_path}/run"
    values = tensors(4)
    store = ObjectStore(url).child(PREFIX)
    for s, (start, end) in enumerate(shard_bounds(NUMEL, 4)):
        store.create(
            layout.sync_input(2, s),
            encode(values[2][start:end], {**_input(2, s), NORM: repr(l2_norm(values[2]))}, codec),
        )
    settings = ExchangeSettings(replicas=4, min_replicas=3, codec=codec, timeout_s=60)
    results = exchange(url, {0: values[0], 1: values[1]}, settings, grace=0.05, in_place=True)
    expected = expected_average(values, [0, 1, 2], codec, 4)
    assert substitute_for(3, [0, 1, 2]) == 0 and sum(len(r.rescued) for r in results.values()) >= 1
    for result in results.values():
        assert result.participants == [0, 1, 2]
        assert torch.equal(result.average, expected)
    with pytest.raises(ValueError, match="out must be a contiguous fp32 CPU tensor of 1001 values"):
        allreduce(
            store,
            values[0],
            prefix=PREFIX,
            identity=IDENTITY,
            rank=0,
            settings=settings,
            grace_s=0,
            out=torch.empty(1000),
        )


def test_a_workspace_serves_one_sync_after_another_and_one_at_a_time(tmp_path: Path) -> None:
    """Each replica keeps its workspace, as the manager does: the second sync reads into the same memory
    and gets its own exact average; a workspace already in use is refused, not shared."""
    url = f"file://{tmp_path}/run"
    settings = ExchangeSettings(replicas=3, min_replicas=3, codec="fp32", timeout_s=60)
    workspaces = {r: Workspace() for r in range(3)}
    first, second = (
        tensors(3),
        {r: torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 + r)) for r in range(3)},
    )
    exchange(url, first, settings, grace=10, workspaces=workspaces, prefix="rounds/1/0")

    def address(workspace: Workspace) -> int:  # of the buffer every gather reads reduced shards into
        return torch.frombuffer(workspace.bytes("scratch", 1), dtype=torch.uint8).data_ptr()

    held = {r: address(w) for r, w in workspaces.items()}
    results = exchange(url, second, settings, grace=10, workspaces=workspaces, prefix="rounds/2/0")
    expected = expected_average(second, [0, 1, 2], "fp32", 3)
    for r, result in results.items():
        assert torch.equal(result.average, expected)
        assert address(workspaces[r]) == held[r]
    busy = Workspace()
    with busy.busy, pytest.raises(RuntimeError, match="in use by another exchange"):
        allreduce(
            ObjectStore(url),
            first[0],
            prefix="rounds/3/0",
            identity=IDENTITY,
            rank=0,
            settings=settings,
            grace_s=0,
            workspace=busy,
        )


class _CreatesAFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _forged(kind: str, marker: Path, numel: int) -> bytes:
    """Replica 2's input for shard 0 as someone who can write to the bucket could make it."""
    identity = {**_input(2, 0), NORM: repr(float(numel))}  # at least the norm of any of these values
    if kind == "pickle":
        return pickle.dumps(_CreatesAFile(marker))
    if kind == "oversized":  # a valid payload with a MiB more behind it
        return encode(torch.ones(numel), identity, "fp32") + bytes(2**20)
    values = torch.ones(numel)
    values[numel // 2] = float("nan") if kind == "nan" else float("inf")
    return encode(values, identity, "fp32")  # the right size, and its own valid checksum


@pytest.mark.parametrize("kind", ["pickle", "nan", "inf", "oversized"])
def test_a_rejected_input_is_left_out_and_never_executed(tmp_path: Path, kind: str) -> None:
    """Replica 2's input for shard 0 is a pickle, holds a NaN or an Inf under a valid checksum, or is a MiB
    larger than any payload of its shard: shard 0 averages replicas 0 and 1 only, the average is finite."""
    url = f"file://{tmp_path}/run"
    values = tensors(3)
    store = ObjectStore(url).child(PREFIX)
    bounds = shard_bounds(NUMEL, 3)
    marker = tmp_path / "executed"
    store.create(layout.sync_input(2, 0), _forged(kind, marker, bounds[0][1] - bounds[0][0]))
    for s in (1, 2):
        start, end = bounds[s]
        store.create(
            layout.sync_input(2, s),
            encode(values[2][start:end], {**_input(2, s), NORM: repr(l2_norm(values[2]))}, "fp32"),
        )
    results = exchange(url, {0: values[0], 1: values[1]}, ExchangeSettings(3, 3, "fp32", 60), grace=0.05)
    full = expected_average(values, [0, 1, 2], "fp32", 3)
    without = expected_average(values, [0, 1], "fp32", 3)
    start, end = bounds[0]
    for result in results.values():
        assert torch.equal(result.average[start:end], without[start:end])
        assert torch.equal(result.average[end:], full[end:])
        assert bool(torch.isfinite(result.average).all())
        # Replica 2 took part, but the round did not average all of it: it is not reported as averaged.
        assert result.participants == [0, 1, 2] and result.contributors == [0, 1]
    assert not marker.exists()


def test_a_replica_the_launcher_gave_up_is_not_waited_for(tmp_path: Path) -> None:
    """Replica 1 was given up (its restart got no hardware): replica 0 alone is everyone expected, so it fixes
    the quorum at once instead of waiting out the grace (up to quorum_grace_max_s, every round) for it. The
    grace here never ends and the sync's deadline is 5 s: before, the exchange failed at that deadline."""
    url = f"file://{tmp_path}/run"
    values = tensors(2)
    result = allreduce(
        ObjectStore(url),
        values[0],
        prefix=PREFIX,
        identity=IDENTITY,
        rank=0,
        settings=ExchangeSettings(2, 1, "fp32", 5),
        grace_s=1e9,
        absent=frozenset({1}),
    )
    assert result.participants == [0] and torch.equal(result.average, values[0])
    quorum = json.loads(ObjectStore(url).get(f"{PREFIX}/{layout.QUORUM}"))
    assert quorum["reason"] == "all arrived"


def test_a_replica_that_cannot_upload_still_receives_the_average(tmp_path: Path) -> None:
    """Replica 1's uploads fail for good; it goes on as a non-participant. It starts first, and replica 0
    only once replica 1 has tried to upload, so the order of events is fixed."""
    url = f"file://{tmp_path}/run"
    values = tensors(2)
    settings = ExchangeSettings(2, 1, "bf16", 60)
    failing = FaultyStore(url, fail_on=r"/in/1-")
    results: dict[int, ExchangeResult] = {}

    def run(rank: int, store: ObjectStore) -> None:
        results[rank] = allreduce(
            store, values[rank], prefix=PREFIX, identity=IDENTITY, rank=rank, settings=settings, grace_s=0.0
        )

    late = threading.Thread(target=run, args=(1, failing))
    late.start()
    while not any(op == "create" and "/in/1-" in key for op, key in list(failing.tried)):
        time.sleep(0.01)
    run(0, ObjectStore(url))
    late.join(timeout=60)
    expected = expected_average(values, [0], "bf16", 2)
    assert results[1].upload_failed and results[1].participants == [0]
    assert torch.equal(results[0].average, expected) and torch.equal(results[1].average, expected)


def test_too_few_replicas_time_out(tmp_path: Path) -> None:
    with pytest.raises(ExchangeError, match="1/2 replicas arrived"):
        exchange(f"file://{tmp_path}/run", tensors(1), ExchangeSettings(2, 2, "fp32", timeout_s=0.3))


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xffnot json",
        b'{"participants": [0, 7]}',
        b'{"participants": []}',
        b"[1, 2]",
        b'{"participants": [1, 0]}',
    ],
)
def test_a_malformed_quorum_record_is_passed_over(tmp_path: Path, garbage: bytes) -> None:
    """Written before anyone fixed the quorum (create-once then refuses everyone): every replica finds it
    malformed and fixes the quorum in the next generation's record; the average is the full one."""
    store = ObjectStore(f"file://{tmp_path}/run").child(PREFIX)
    store.create(layout.QUORUM, garbage)
    values = tensors(2)
    results = exchange(f"file://{tmp_path}/run", values, ExchangeSettings(2, 2, "fp32", 30))
    expected = expected_average(values, [0, 1], "fp32", 2)
    assert all(torch.equal(r.average, expected) and r.participants == [0, 1] for r in results.values())
    assert json.loads(store.get(layout.quorum_generation(1)))["participants"] == [0, 1]


def test_a_sync_whose_every_quorum_record_is_malformed_says_what_to_do(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/run").child(PREFIX)
    for generation in range(MAX_QUORUM_GENERATIONS):
        store.create(layout.quorum_generation(generation), b"garbage")
    with pytest.raises(
        ExchangeError, match=r"quorum-3.json is malformed .* delete .*quorum\*.json and resume"
    ):
        exchange(f"file://{tmp_path}/run", tensors(2), ExchangeSettings(2, 1, "fp32", 10))


def test_shard_helpers() -> None:
    assert shard_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert shard_bounds(1, 2) == [(0, 0), (0, 1)]
    keys = {layout.sync_input(0, 0), layout.sync_input(0, 1), layout.sync_input(1, 0), layout.QUORUM}
    assert complete_ranks(keys, 2) == [0]
    assert [substitute_for(s, [1, 3]) for s in range(4)] == [1, 3, 1, 3]


def test_grace_adapts_to_arrivals_within_bounds() -> None:
    settings = GraceSettings(min_s=0.5, max_s=30.0, mads=4.0)
    assert grace_s([], settings) == 30.0  # nothing observed yet: be patient
    assert grace_s([0.1, 0.1, 0.1], settings) == 0.5  # floor
    # median 2, MAD 1 -> 2 + 4 * 1.4826
    assert grace_s([1.0, 2.0, 3.0], settings) == pytest.approx(2 + 4 * 1.4826)
    assert grace_s([100.0], settings) == 30.0  # cap


def test_the_last_replica_to_arrive_observes_the_arrival_of_all(tmp_path: Path) -> None:
    """The wait until all N arrived feeds the adaptive grace. The last replica to arrive usually finds the
    quorum already fixed; it must record its wait too, or its grace would stay at the cap. Here the quorum
    is fixed (by 'another replica') the moment replica 2 finishes uploading."""
    url = f"file://{tmp_path}/run"
    values = tensors(3)
    store = ObjectStore(url).child(PREFIX)
    for peer in (0, 1):
        for s, (start, end) in enumerate(shard_bounds(NUMEL, 3)):
            identity = {**_input(peer, s), NORM: repr(l2_norm(values[peer]))}
            store.create(layout.sync_input(peer, s), encode(values[peer][start:end], identity, "fp32"))

    class QuorumFixedByAPeer(ObjectStore):
        def _attempt(self, op, key, fn):
            result = fn()
            if op == "create" and key == layout.sync_input(2, 2):
                store.create("quorum.json", json.dumps({"participants": [0, 1, 2]}).encode())
            return result

    result = exchange(
        url, {2: values[2]}, ExchangeSettings(3, 3, "fp32", 60), stores={2: QuorumFixedByAPeer(url)}
    )[2]
    assert result.participants == [0, 1, 2]
    assert result.waited_for_all_s is not None
    assert torch.equal(result.average, expected_average(values, [0, 1, 2], "fp32", 3))


@pytest.mark.parametrize("forgery", ["no MAC", "wrong MAC"])
def test_with_a_run_key_an_input_without_a_valid_mac_is_left_out(tmp_path: Path, forgery: str) -> None:
    """An authenticated run: replica 2's input for shard 0 was written by someone with access to the bucket
    but not the run key, with a valid checksum and no MAC, or a MAC under another key. It is rejected and
    nothing of it averaged; replica 2's genuine inputs of the other shards are averaged as usual."""
    url = f"file://{tmp_path}/run"
    key = RunKey.generate()
    values = tensors(3)
    store = ObjectStore(url).child(PREFIX)
    bounds = shard_bounds(NUMEL, 3)
    for s, (start, end) in enumerate(bounds):
        identity = {**_input(2, s), NORM: repr(l2_norm(values[2]))}
        writer = (None if forgery == "no MAC" else RunKey.generate()) if s == 0 else key
        store.create(layout.sync_input(2, s), encode(values[2][start:end], identity, "fp32", writer))
    settings = ExchangeSettings(3, 3, "fp32", 60, key=key)
    results = exchange(url, {0: values[0], 1: values[1]}, settings, grace=0.05)
    full = expected_average(values, [0, 1, 2], "fp32", 3)
    without = expected_average(values, [0, 1], "fp32", 3)
    start, end = bounds[0]
    for result in results.values():
        assert torch.equal(result.average[start:end], without[start:end])
        assert torch.equal(result.average[end:], full[end:])  # the MAC changes no value
        assert result.participants == [0, 1, 2] and result.contributors == [0, 1]
    reduced = store.get(layout.sync_output(1))
    assert "blake3_mac" in str(read_header(reduced)[0]["__metadata__"])


def test_without_a_key_a_keyed_reader_and_writer_are_not_needed(tmp_path: Path) -> None:
    """The default (no run key) is unchanged: payloads carry the xxh3 checksum, no MAC."""
    url = f"file://{tmp_path}/run"
    values = tensors(2)
    results = exchange(url, values, ExchangeSettings(2, 2, "fp32", 60))
    assert torch.equal(results[0].average, expected_average(values, [0, 1], "fp32", 2))
    metadata = read_header(ObjectStore(url).child(PREFIX).get(layout.sync_output(0)))[0]["__metadata__"]
    assert "xxh3_128" in metadata and "blake3_mac" not in metadata


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_contribution_far_larger_than_the_others_is_left_out_of_every_shard(
    tmp_path: Path, codec: str
) -> None:
    """Four replicas; replica 3's whole pseudo-gradient blew up to 1e30 per value (finite, its checksum
    valid). With the robust average every shard averages replicas 0-2 only, on every replica; without it
    the blow-up is averaged in."""
    values = tensors(4)
    values[3] = torch.full((NUMEL,), 1e30)
    robust = ExchangeSettings(4, 4, codec, 60, outlier_factor=10.0)
    results = exchange(f"file://{tmp_path}/robust", values, robust, grace=10)
    expected = expected_average({r: values[r] for r in range(3)}, [0, 1, 2], codec, 4)
    for result in results.values():
        assert result.participants == [0, 1, 2, 3] and result.contributors == [0, 1, 2]
        assert torch.equal(result.average, expected)
    plain = exchange(f"file://{tmp_path}/plain", values, ExchangeSettings(4, 4, codec, 60), grace=10)
    assert plain[0].contributors == [0, 1, 2, 3] and float(plain[0].average.abs().max()) > 1e29


def test_a_shard_larger_than_the_whole_it_claims_to_be_part_of_is_left_out(tmp_path: Path) -> None:
    """Replica 2's input of shard 0 holds 1e30 values under a valid checksum and states a norm as small as
    the others': its own values contradict it, so it is rejected whatever the median says (and with two
    replicas, too few for a median, as well)."""
    url = f"file://{tmp_path}/run"
    values = tensors(3)
    store = ObjectStore(url).child(PREFIX)
    bounds = shard_bounds(NUMEL, 3)
    for s, (start, end) in enumerate(bounds):
        identity = {**IDENTITY, "local": "0", "rank": "2", "shard": str(s), NORM: repr(l2_norm(values[2]))}
        shard = torch.full((end - start,), 1e30) if s == 0 else values[2][start:end]
        store.create(layout.sync_input(2, s), encode(shard, identity, "fp32"))
    results = exchange(url, {0: values[0], 1: values[1]}, ExchangeSettings(3, 3, "fp32", 60), grace=0.05)
    start, end = bounds[0]
    without = expected_average(values, [0, 1], "fp32", 3)
    full = expected_average(values, [0, 1, 2], "fp32", 3)
    for result in results.values():
        assert torch.equal(result.average[start:end], without[start:end])
        assert torch.equal(result.average[end:], full[end:])
        assert result.contributors == [0, 1]


def test_outliers_are_judged_against_the_lower_median_of_the_nonzero_norms() -> None:
    """Hand-computed. The lower median of (1, 2, 3, 40) is 2, so with factor 10 40 (> 20) is out and 19 is not;
    zeros are no reference (three zeros of five would make the median 0 and reject 1 and 1.2); the count that
    turns the rule on is the quorum's, so a shard whose owner read only two of three inputs still judges them;
    a quorum of two turns it off, as does None."""
    assert list(outliers({0: 1.0, 1: 2.0, 2: 3.0, 3: 40.0}, 10.0, 4)) == [3]
    assert outliers({0: 1.0, 1: 2.0, 2: 3.0, 3: 19.0}, 10.0, 4) == {}
    assert outliers({0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0, 4: 1.2}, 10.0, 5) == {}
    assert list(outliers({0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0, 4: 12.0}, 10.0, 5)) == [4]
    assert outliers({0: 0.0, 1: 0.0, 2: 0.0}, 10.0, 3) == {}
    assert list(outliers({0: 1.0, 2: 1e30}, 10.0, 3)) == [2]
    assert outliers({0: 1.0, 1: 1e30}, 10.0, 2) == {}
    assert outliers({0: 1.0, 1: 1.0, 2: 1e30}, None, 3) == {}
    assert (
        "more than 10 times the median 1 of the 3 non-zero contributions"
        in outliers({0: 1.0, 1: 1.0, 2: 1e30}, 10.0, 3)[2]
    )


def test_an_unreadable_input_leaves_the_outlier_rule_on_in_its_shard(tmp_path: Path) -> None:
    """Three replicas; replica 2's pseudo-gradient blew up (1e30 per value, a valid payload) and replica 1's
    input of shard 0 is unreadable. Shard 0's owner reads two inputs but the quorum is three: replica 2 is left
    out there too, as in every other shard, and no shard averages the blow-up."""
    url = f"file://{tmp_path}/run"
    values = tensors(3)
    values[2] = torch.full((NUMEL,), 1e30)
    ObjectStore(url).child(PREFIX).create(layout.sync_input(1, 0), b"not a payload")
    settings = ExchangeSettings(3, 3, "fp32", 60, outlier_factor=10.0)
    results = exchange(url, values, settings, grace=10)
    bounds = shard_bounds(NUMEL, 3)
    for result in results.values():
        assert result.summed == {0: [0], 1: [0, 1], 2: [0, 1]}
        assert float(result.average.abs().max()) < 1e3
        start, end = bounds[0]
        assert torch.equal(result.average[start:end], values[0][start:end])


def test_a_retried_sync_keeps_the_residual_of_the_inputs_it_stored_before(tmp_path: Path) -> None:
    """A replica's earlier attempt at a sync stored its input of shard 1 (made from other values); its retry
    finds it there: the sync averages the stored input, so the residual of shard 1 is what the retry was to
    send minus what the stored input carries, not minus what the retry's own encoding would have carried. A
    second retry, after the quorum was fixed, accounts for every stored input the same way."""
    n, numel = 2, 20_001
    codec = Sparse(0.02)
    url = f"file://{tmp_path}/run"
    values = tensors(n, numel)
    earlier = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    residual = torch.randn(numel, generator=torch.Generator().manual_seed(8))
    bounds = shard_bounds(numel, n)
    (s0, e0), (s1, e1) = bounds
    identity = {**IDENTITY, "local": "0", "rank": "0", "shard": "1"}
    stored = encode((earlier + residual)[s1:e1], {**identity, NORM: repr(l2_norm(earlier + residual))}, codec)
    assert ObjectStore(url).child(PREFIX).create(layout.sync_input(0, 1), stored)
    settings = ExchangeSettings(replicas=n, min_replicas=n, codec=codec, timeout_s=60)
    residuals = {r: Residuals(residual.clone(), torch.zeros(e - s)) for r, (s, e) in enumerate(bounds)}
    results = exchange(url, values, settings, grace=10, residuals=residuals)
    sending = values[0] + residual
    sent = torch.cat(
        [
            expand(compress(sending[s0:e0], codec), codec, e0 - s0),
            decode(stored, identity, codec, e1 - s1),
        ]
    )
    assert not torch.equal(sent[s1:e1], expand(compress(sending[s1:e1], codec), codec, e1 - s1))
    assert torch.equal(results[0].residual.inputs, sending - sent)
    # Retried once more, now that the quorum is fixed: no input is written, every one is the stored one.
    again = allreduce(
        ObjectStore(url),
        values[0],
        prefix=PREFIX,
        identity=IDENTITY,
        rank=0,
        settings=settings,
        grace_s=0,
        residual=residuals[0],
    )
    assert again.participants == [0, 1] and torch.equal(again.average, results[0].average)
    assert torch.equal(again.residual.inputs, sending - sent)


def test_every_shard_judges_every_replica_alike_when_an_input_is_unreadable_in_one(tmp_path: Path) -> None:
    """Three replicas of norms about 1, 2 and 5 (x 31.6), factor 3: the median is replica 1's, and 5 < 3 x 2
    keeps replica 2. Replica 1's input of shard 1 is unreadable. Shard 1's owner still judges on the norms all
    three published, so replica 2 is kept there as everywhere; judged on the inputs it could read (1 and 5,
    median 1) it would be left out of shard 1 alone."""
    url = f"file://{tmp_path}/run"
    values = {r: v * scale for (r, v), scale in zip(tensors(3).items(), (1.0, 2.0, 5.0), strict=True)}
    ObjectStore(url).child(PREFIX).create(layout.sync_input(1, 1), b"not a payload")
    results = exchange(url, values, ExchangeSettings(3, 3, "fp32", 60, outlier_factor=3.0), grace=10)
    for result in results.values():
        assert result.summed == {0: [0, 1, 2], 1: [0, 2], 2: [0, 1, 2]}
        assert result.contributors == [0, 2]


def test_a_retried_sync_is_judged_on_the_norm_its_first_attempt_published(tmp_path: Path) -> None:
    """Replica 2's first attempt at a sync (its pseudo-gradient blown up 100-fold) stored its input of shard 0
    and then failed; its retry, with a sane pseudo-gradient, writes shards 1 and 2. The sync averages the
    stored input, so the retry states the first attempt's norm in its new inputs too, and every shard's owner
    leaves replica 2 out alike; before, shard 0 left it out and shards 1 and 2 averaged it."""
    url = f"file://{tmp_path}/run"
    values = tensors(3)
    settings = ExchangeSettings(3, 3, "fp32", 0.5, outlier_factor=10.0)
    first = FaultyStore(url, fail_on=r"/in/2-[12]$")
    with pytest.raises(ExchangeError, match="only 0/3 replicas arrived"):
        allreduce(
            first, values[2] * 100, prefix=PREFIX, identity=IDENTITY, rank=2, settings=settings, grace_s=0
        )
    sync = ObjectStore(url).child(PREFIX)
    assert sorted(sync.list(layout.sync_inputs())) == ["2-0"]
    results = exchange(url, values, ExchangeSettings(3, 3, "fp32", 60, outlier_factor=10.0), grace=10)
    for result in results.values():
        assert result.summed == {0: [0, 1], 1: [0, 1], 2: [0, 1]}
    stated = {
        s: read_header(sync.get(layout.sync_input(2, s)))[0]["__metadata__"][NORM]  # type: ignore[index]
        for s in range(3)
    }
    assert stated == {s: repr(l2_norm(values[2] * 100)) for s in range(3)}


def test_an_input_whose_norm_is_not_the_published_one_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Replica 2 published its norm in a first attempt that stored no input; an input of shard 1 then found
    in its name states another norm (1.5 times it: within the factor, so the median would not object). It is
    refused, with a log line naming both numbers, as a bad checksum would be; its other inputs, which state the
    published norm, are averaged."""
    url = f"file://{tmp_path}/run"
    values = tensors(3)
    settings = ExchangeSettings(3, 3, "fp32", 0.5, outlier_factor=10.0)
    with pytest.raises(ExchangeError, match="only 0/3 replicas arrived"):
        allreduce(
            FaultyStore(url, fail_on=r"/in/2-"),
            values[2],
            prefix=PREFIX,
            identity=IDENTITY,
            rank=2,
            settings=settings,
            grace_s=0,
        )
    published = l2_norm(values[2])
    start, end = shard_bounds(NUMEL, 3)[1]
    other = repr(published * 1.5)
    ObjectStore(url).child(PREFIX).create(
        layout.sync_input(2, 1), encode(values[2][start:end], {**_input(2, 1), NORM: other}, "fp32")
    )
    results = exchange(url, values, ExchangeSettings(3, 3, "fp32", 60, outlier_factor=10.0), grace=10)
    for result in results.values():
        assert result.summed == {0: [0, 1, 2], 1: [0, 1], 2: [0, 1, 2]}
    refusals = [
        r.getMessage() for r in caplog.records if "rejected" in r.getMessage() and "/in/2-1" in r.getMessage()
    ]
    assert refusals and f"states a norm of {float(other)!r}" in refusals[0]
    assert f"replica 2 published {published!r}" in refusals[0]


def test_with_a_run_key_a_forged_norm_record_leaves_its_replica_out_of_every_shard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An authenticated run: someone without the key created replica 2's norm record first, stating a
    tiny norm (to hide a blow-up, or to make an honest replica's inputs look absurd). Its MAC is missing, so
    no owner judges replica 2 on it: replica 2 is left out of every shard alike, and says why in its log."""
    url = f"file://{tmp_path}/run"
    key = RunKey.generate()
    values = tensors(3)
    forged = {"norm": repr(1e-6), "identity": {**IDENTITY, "local": "0", "rank": "2"}}
    ObjectStore(url).child(PREFIX).create(layout.sync_norm(2), json.dumps(forged).encode())
    results = exchange(
        url, values, ExchangeSettings(3, 3, "fp32", 60, key=key, outlier_factor=10.0), grace=10
    )
    expected = expected_average(values, [0, 1], "fp32", 3)
    for result in results.values():
        assert result.summed == {0: [0, 1], 1: [0, 1], 2: [0, 1]}
        assert torch.equal(result.average, expected)
    assert "own norm record 0/norm/2.json is unusable (its MAC is missing or wrong)" in caplog.text


def test_a_replica_of_two_ranks_is_judged_on_its_whole_norm_in_both_parts(tmp_path: Path) -> None:
    """Three replicas of two local ranks each; replica 2's part on local rank 0 blew up 100-fold, its part on
    local rank 1 is sane. Each local rank's exchange judges replica 2 on its whole pseudo-gradient (the root of
    the sum of its parts' squares, over 70 times the others'), so both leave it out of every shard: a replica
    commits a sync on all of its ranks alike, and so it is averaged in on all or none."""
    url = f"file://{tmp_path}/run"
    parts = {local: tensors(3) for local in range(2)}
    parts[0][2] = parts[0][2] * 100
    results: dict[int, dict[int, ExchangeResult]] = {}

    def local_rank(local: int) -> None:
        settings = ExchangeSettings(3, 3, "fp32", 60, local_rank=local, local_ranks=2, outlier_factor=10.0)
        results[local] = exchange(url, parts[local], settings, grace=10)

    threads = [threading.Thread(target=local_rank, args=(local,)) for local in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for local in range(2):
        for result in results[local].values():
            assert result.summed == {0: [0, 1], 1: [0, 1], 2: [0, 1]}, local
