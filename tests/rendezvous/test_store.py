"""ObjectStore on file://, memory:// and a real S3 server (moto): atomicity, create-if-absent, freshness,
reads into buffers, retries of transient faults only."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import pytest
from botocore.exceptions import ClientError
from faults import FaultyStore, InjectedFault
from fsspec.implementations.memory import MemoryFileSystem

from composer_serverless.rendezvous.retry import RetryPolicy, is_transient
from composer_serverless.rendezvous.store import ObjectStore, StoreError


@pytest.fixture(params=["file", "memory", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    if request.param == "memory":
        return f"memory://store-{uuid.uuid4().hex[:8]}"
    return request.getfixturevalue("s3_url")


def test_put_get_list_delete(store_url: str) -> None:
    store = ObjectStore(store_url)
    store.ensure_root()
    store.put("a/b/x", b"one")
    store.put("a/b/x", b"two")
    store.put("a/c", b"three")
    assert store.get("a/b/x") == b"two"
    assert store.list("a") == ["b", "c"]
    assert store.list_tree("a") == ["b/x", "c"]
    assert store.list_tree("missing") == [] and store.list("missing") == []
    assert store.exists("a/c") and not store.exists("a/d")
    store.delete("a/b")
    assert store.list_tree("a") == ["c"]
    with pytest.raises(FileNotFoundError):
        store.get("a/b/x")


def test_listings_are_never_stale(store_url: str) -> None:
    """A second store instance (another replica) sees creations and deletions at once."""
    reader, writer = ObjectStore(store_url), ObjectStore(store_url)
    assert reader.list("p") == []
    writer.put("p/1", b"x")
    assert reader.list("p") == ["1"] and reader.exists("p/1")
    writer.put("p/2", b"x")
    writer.delete("p/1")
    assert reader.list("p") == ["2"] and not reader.exists("p/1")


def test_create_is_exclusive_and_recognises_its_own_object(store_url: str) -> None:
    store = ObjectStore(store_url)
    assert store.create("q.json", b"mine")
    assert not store.create("q.json", b"theirs")
    # The same bytes again: what a retried conditional PUT whose first response was lost sees.
    assert store.create("q.json", b"mine")
    assert store.get("q.json") == b"mine"


class _SlowlyCopiedDict(dict):
    """The memory filesystem's dict, its items yielded with a pause between them: a thread switch inside
    the copy a listing takes (a CI run once had one there) becomes likely instead of rare."""

    def items(self):  # type: ignore[override]
        for item in super().items():
            time.sleep(0.0005)
            yield item


def test_memory_store_operations_are_atomic_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A listing never sees the dict another thread is writing mid-copy: without the store's lock the
    listing below raises "dictionary changed size during iteration" within a few tries."""
    monkeypatch.setattr(MemoryFileSystem, "store", _SlowlyCopiedDict())
    store = ObjectStore(f"memory://atomic-{uuid.uuid4().hex[:8]}")
    for i in range(20):
        store.put(f"r/seed{i}", b"x")
    listed = threading.Event()
    written: list[int] = []

    def write() -> None:
        while not listed.is_set():
            store.put(f"r/w{len(written)}", b"y")
            written.append(1)
            time.sleep(0.001)  # outside the lock: the listings get their turn at it

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        listings = [len(store.list_tree("r"))]
        while len(written) < 5:  # listings go on until they have overlapped writes
            time.sleep(0.001)
            listings.append(len(store.list_tree("r")))
    finally:
        listed.set()
        writer.join(timeout=60)
    assert listings == sorted(listings) and listings[0] >= 20
    assert len(store.list_tree("r")) == 20 + len(written)


def test_an_object_can_be_written_from_several_buffers(store_url: str) -> None:
    store = ObjectStore(store_url)
    parts = [b"header:", bytearray(b"values "), memoryview(b"and scales")]
    store.put("p", parts)
    assert store.get("p") == b"header:values and scales"
    assert store.create("c", parts) and store.get("c") == b"header:values and scales"
    assert store.create("c", [b"header:values ", b"and scales"])  # the same bytes, cut elsewhere: ours
    assert not store.create("c", [b"header:", b"other"])


def test_get_into_streams_into_a_preallocated_buffer(store_url: str) -> None:
    store = ObjectStore(store_url)
    payload = bytes(range(256)) * 4096
    store.put("big", payload)
    buffer = bytearray(len(payload) + 100)
    assert store.get_into("big", buffer) == len(payload)
    assert bytes(buffer[: len(payload)]) == payload
    with pytest.raises(ValueError, match="more than"):
        store.get_into("big", bytearray(10))
    with pytest.raises(FileNotFoundError):
        store.get_into("absent", buffer)


def test_probe_refuses_a_backend_that_ignores_create_if_absent(tmp_path) -> None:
    class Overwriting(ObjectStore):
        """Like s3rver: accepts If-None-Match and overwrites anyway."""

        def _create_once(self, path, data):
            self._local_write(path, data, exclusive=False)

    with pytest.raises(StoreError, match="does not enforce create-if-absent"):
        Overwriting(f"file://{tmp_path}/s").ensure_root()
    ObjectStore(f"file://{tmp_path}/s").ensure_root()


def test_an_unusable_root_is_a_store_error(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot write to store"):
        ObjectStore(f"file://{blocker}/runs").ensure_root()


def test_transient_faults_are_retried_and_logged(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    store = FaultyStore(store_url, fraction=1.0, lost_fraction=0.0)
    with caplog.at_level(logging.WARNING, logger="composer_serverless.rendezvous.store"):
        store.put("k", b"v")
        assert store.get("k") == b"v"
    assert len(store.injected) == 2
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 2 and all("InjectedFault" in m for m in retries)
    assert "put k" in retries[0] and "get k" in retries[1]


def test_a_lost_create_response_still_counts_as_created(store_url: str) -> None:
    store = FaultyStore(store_url, lost_fraction=1.0)
    assert store.create("marker", b"mine")
    assert store.injected == ["lost create marker"]
    assert not store.create("marker", b"other")


def test_answers_are_not_retried(tmp_path) -> None:
    store = FaultyStore(f"file://{tmp_path}/s", fail_on="denied")
    with pytest.raises(FileNotFoundError):
        store.get("absent")
    assert store.tried == {("get", "absent"): 1}
    with pytest.raises(PermissionError):
        store.put("denied", b"x")
    assert store.tried[("put", "denied")] == 1


def test_retries_are_bounded(tmp_path) -> None:
    class AlwaysFailing(ObjectStore):
        def _attempt(self, op, key, fn):
            raise InjectedFault(f"{op} {key}")

    store = AlwaysFailing(f"file://{tmp_path}/s", retry=RetryPolicy(attempts=3, first_s=0.001, cap_s=0.001))
    with pytest.raises(InjectedFault):
        store.put("k", b"v")


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


@pytest.mark.parametrize(
    ("code", "status", "transient"),
    [
        ("SlowDown", 503, True),
        ("InternalError", 500, True),
        ("BadGateway", 502, True),
        ("ConditionalRequestConflict", 409, True),
        ("RequestTimeout", 400, True),
        ("TooManyRequests", 429, True),
        ("PreconditionFailed", 412, False),
        ("NoSuchKey", 404, False),
        ("AccessDenied", 403, False),
        ("InvalidArgument", 400, False),
    ],
)
def test_s3_errors_are_classified_by_code_and_status(code: str, status: int, transient: bool) -> None:
    error = _client_error(code, status)
    assert is_transient(error) is transient
    # s3fs re-raises botocore errors as OSErrors with the original as __cause__.
    wrapped = OSError(5, code)
    wrapped.__cause__ = error
    assert is_transient(wrapped) is transient


def test_an_error_raised_while_handling_another_is_classified_by_itself() -> None:
    try:
        try:
            raise FileExistsError("lost the create race") from _client_error("PreconditionFailed", 412)
        except FileExistsError:
            raise InjectedFault("connection reset while reading the winner back")  # noqa: B904 - the implicit context is the point
    except InjectedFault as e:
        assert is_transient(e)


def test_local_errors_are_classified() -> None:
    assert is_transient(TimeoutError()) and is_transient(ConnectionResetError())
    assert not is_transient(FileExistsError()) and not is_transient(ValueError())


def test_a_write_refused_during_an_outage_lands_once_the_store_is_back(tmp_path) -> None:
    """The store is full until a file appears (a thread makes it once the write has been refused 3 times):
    with an outage window the write waits it out; without one, it fails at once; past the window, it fails."""
    start, end = tmp_path / "outage-start", tmp_path / "outage-end"
    start.touch()
    policy = RetryPolicy(first_s=0.001, outage_poll_s=0.01)
    store = FaultyStore(f"file://{tmp_path}/s", outage=(str(start), str(end)))
    store.retry = policy
    with pytest.raises(OSError, match="no space left"):
        store.put("k", b"v")  # outage_s = 0: a launcher's probe must fail at once
    assert store.tried.get(("put", "k"), 0) == 0  # refused before reaching the backend, once

    store.tolerate_outages(60.0)
    original = store._attempt
    calls = 0

    def counting(op, key, fn):
        nonlocal calls
        calls += 1
        if calls == 3:
            end.touch()  # the store comes back after the third refusal
        return original(op, key, fn)

    store._attempt = counting
    store.put("k", b"v")
    assert store.get("k") == b"v" and calls == 4

    end.unlink()
    store.tolerate_outages(0.05)
    with pytest.raises(OSError, match="no space left"):
        store.put("k2", b"v")  # the outage outlasts the window


def test_a_failed_local_write_leaves_no_temporary_file(tmp_path) -> None:
    class FullDisk:
        """A part whose write fails half-way, as ENOSPC does."""

    store = ObjectStore(f"file://{tmp_path}/s")
    with pytest.raises(TypeError):
        store.put("k", [b"header", FullDisk()])  # type: ignore[list-item]
    assert list((tmp_path / "s").iterdir()) == []


def test_modified_is_the_stores_own_time_of_the_last_write(
    store_url: str, request: pytest.FixtureRequest
) -> None:
    """What a lease's age is measured with: the time the store gave the object, not the writer's clock."""
    store = ObjectStore(store_url)
    store.put("t/x", b"one")
    if store_url.startswith("s3://"):
        import boto3

        bucket, _, prefix = store_url.removeprefix("s3://").partition("/")
        endpoint = request.getfixturevalue("s3_endpoint")
        head = boto3.client("s3", endpoint_url=endpoint).head_object(Bucket=bucket, Key=f"{prefix}/t/x")
        assert store.modified("t/x") == head["LastModified"].timestamp()
    elif store.is_local:
        assert store.modified("t/x") == pytest.approx(os.stat(store.path("t/x")).st_mtime, abs=1e-6)
    first = store.modified("t/x")
    store.put("t/x", b"two")
    assert store.modified("t/x") >= first
    with pytest.raises(FileNotFoundError):
        store.modified("t/missing")
