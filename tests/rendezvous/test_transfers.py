"""Parallel transfers: several objects at once, large S3 objects in parallel parts (multipart uploads, ranged
GETs) against a real S3 server (moto), with the store's guarantees intact: create-if-absent on the multipart
path, a retry per part, no part or temporary object left by a failed upload, the size guard."""

from __future__ import annotations

import asyncio
import os
import threading

import boto3
import pytest
from faults import FaultyStore

from composer_serverless.rendezvous.store import ObjectStore, ObjectTooLarge
from composer_serverless.rendezvous.transfers import (
    MIN_PART_BYTES,
    REREADS,
    ObjectChanged,
    S3Parts,
    Transfers,
    part_ranges,
    run_all,
)

PART = MIN_PART_BYTES


def _bucket_and_key(store: ObjectStore, key: str) -> tuple[str, str]:
    bucket, _, rest = store.path(key).partition("/")
    return bucket, rest


def _etag(store: ObjectStore, key: str) -> str:
    bucket, name = _bucket_and_key(store, key)
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"]).head_object(
        Bucket=bucket, Key=name
    )["ETag"]


def _open_uploads(store: ObjectStore) -> list[dict]:
    bucket, _ = _bucket_and_key(store, "x")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_part_ranges_cover_the_object_once() -> None:
    assert part_ranges(12, 5) == [(0, 5), (5, 10), (10, 12)]
    assert part_ranges(10, 5) == [(0, 5), (5, 10)]
    assert part_ranges(0, 5) == []


def test_transfers_refuse_settings_no_store_takes() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Transfers(concurrency=0)
    with pytest.raises(ValueError, match="S3's minimum"):
        Transfers(part_bytes=1 << 20)


def test_run_all_runs_concurrently_waits_for_all_and_raises_the_first_failure() -> None:
    entered = threading.Barrier(3, timeout=30)  # only passable if three tasks run at once
    finished = []

    def task(i: int) -> int:
        entered.wait()
        finished.append(i)
        if i == 1:
            raise KeyError(i)
        return i * 10

    with pytest.raises(KeyError):
        run_all([lambda i=i: task(i) for i in range(3)], workers=3)
    assert sorted(finished) == [0, 1, 2]  # the others finished before the failure was raised
    assert run_all([lambda i=i: i for i in range(5)], workers=1) == [0, 1, 2, 3, 4]


def test_map_moves_concurrency_objects_at_once(tmp_path) -> None:
    store = ObjectStore(f"file://{tmp_path}/s", transfers=Transfers(concurrency=3))
    lock, now, most = threading.Lock(), [0], [0]
    both = threading.Barrier(3, timeout=30)

    def put(i: int) -> int:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        if i < 3:
            both.wait()  # the first three meet: three at once, really
        store.put(f"o/{i}", bytes([i]) * 10)
        with lock:
            now[0] -= 1
        return i

    assert store.map(put, list(range(9))) == list(range(9))
    assert most[0] == 3
    assert [store.get(f"o/{i}") for i in range(9)] == [bytes([i]) * 10 for i in range(9)]


def test_objects_and_their_parts_together_hold_at_most_concurrency_requests(s3_url, monkeypatch) -> None:
    """Four 3-part objects moved by ``map`` two at a time, each in parts two at a time: without the shared
    slots up to four part requests would be in flight; every S3 request is counted where s3fs sends it."""
    store = ObjectStore(s3_url, transfers=Transfers(concurrency=2, part_bytes=PART))
    fs = store._fs
    original, now, most = fs._call_s3, [0], [0]

    async def counted(method, *args, **kwargs):
        if method in ("upload_part", "get_object"):
            now[0] += 1  # on the filesystem's one event loop: no lock needed
            most[0] = max(most[0], now[0])
            try:
                await asyncio.sleep(0.02)  # long enough for others to start, if they may
                return await original(method, *args, **kwargs)
            finally:
                now[0] -= 1
        return await original(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", counted)
    blobs = [os.urandom(2 * PART + 1) for _ in range(4)]
    store.map(lambda i: store.put(f"o/{i}", blobs[i]), list(range(4)))
    assert store.map(lambda i: store.get(f"o/{i}"), list(range(4))) == blobs
    assert 1 <= most[0] <= 2


def test_a_large_object_goes_up_in_parts_and_comes_back_whole(s3_url: str) -> None:
    store = ObjectStore(s3_url, transfers=Transfers(concurrency=4, part_bytes=PART))
    data = os.urandom(2 * PART + 12345)
    header, body = data[:100], memoryview(data)[100:]  # a payload as the codec writes it: header, tensor
    store.put("big", [header, body])
    assert _etag(store, "big").endswith('-3"')  # a multipart upload of three parts
    assert store.get("big") == data
    out = bytearray(len(data) + 999)
    assert store.get_into("big", out) == len(data)
    assert bytes(out[: len(data)]) == data
    with pytest.raises(ObjectTooLarge):
        store.get_into("big", bytearray(PART + 1))  # larger than a part, smaller than the object


def test_create_if_absent_holds_on_the_multipart_path(s3_url: str) -> None:
    store = ObjectStore(s3_url, transfers=Transfers(concurrency=4, part_bytes=PART))
    mine, theirs = os.urandom(2 * PART + 1), os.urandom(2 * PART + 1)
    assert store.create("once", mine)
    assert not store.create("once", theirs)  # If-None-Match: * on CompleteMultipartUpload
    assert store.create("once", mine)  # our own object: a retried create whose answer was lost
    assert store.get("once") == mine
    assert _open_uploads(store) == []  # the losing upload was aborted, not left behind


def test_a_part_that_fails_once_is_retried_alone(s3_url: str) -> None:
    store = FaultyStore(s3_url, fraction=1.0)  # every first attempt of every request fails
    store.configure_transfers(Transfers(concurrency=3, part_bytes=PART))
    data = os.urandom(3 * PART)
    store.put("big", data)
    assert store.get("big") == data
    parts = [entry for entry in store.injected if " part " in entry]
    assert len(parts) == 3  # each part failed once and was sent again on its own


def test_a_failed_upload_leaves_no_object_and_no_parts(s3_url: str) -> None:
    store = FaultyStore(s3_url, fail_on=r"big part 2$")
    store.configure_transfers(Transfers(concurrency=3, part_bytes=PART))
    with pytest.raises(PermissionError):
        store.put("big", os.urandom(3 * PART))
    assert not store.exists("big")
    assert _open_uploads(store) == []


def test_an_empty_object_reads_back_empty_through_the_ranged_path(s3_url: str) -> None:
    store = ObjectStore(s3_url, transfers=Transfers(concurrency=2, part_bytes=PART))
    store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.get_into("empty", bytearray(2 * PART)) == 0


def test_a_lost_answer_to_a_multipart_upload_is_not_a_failure(s3_url: str) -> None:
    """Every write's first answer is lost after it took effect (the start, each part, the completion): the
    retries finish the upload, and a create recognises the object as its own."""
    store = FaultyStore(s3_url, lost_fraction=1.0)
    store.configure_transfers(Transfers(concurrency=2, part_bytes=PART))
    data = os.urandom(2 * PART + 7)
    assert store.create("mine", data)
    store.put("again", data)
    assert store.get("mine") == data and store.get("again") == data
    assert any(entry.endswith("mine complete") for entry in store.injected)


def _replace_after_first_get(monkeypatch: pytest.MonkeyPatch, store: ObjectStore, key: str, times: int):
    """Make ``key`` be rewritten (a new version, other bytes) right after the first ranged GET of each read,
    ``times`` times; returns the versions written."""
    bucket, name = _bucket_and_key(store, key)
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    original, versions = S3Parts._get, []

    def get(self, bucket_, name_, path, view, span, etag=None):
        out = original(self, bucket_, name_, path, view, span, etag)
        if span is not None and span[0] == 0 and len(versions) < times:
            versions.append(os.urandom(2 * PART + 3))
            client.put_object(Bucket=bucket, Key=name, Body=versions[-1])
        return out

    monkeypatch.setattr(S3Parts, "_get", get)
    return versions


def test_an_object_replaced_while_it_is_read_is_read_again_whole(s3_url, monkeypatch) -> None:
    """If-Match on the ranged GETs after the first: the read that saw the object change starts over and
    returns the new version whole, never a mix of two."""
    store = ObjectStore(s3_url, transfers=Transfers(concurrency=2, part_bytes=PART))
    store.put("big", os.urandom(2 * PART + 3))
    versions = _replace_after_first_get(monkeypatch, store, "big", times=1)
    assert store.get("big") == versions[0]


def test_an_object_that_keeps_changing_is_refused(s3_url, monkeypatch) -> None:
    store = ObjectStore(s3_url, transfers=Transfers(concurrency=2, part_bytes=PART))
    store.put("big", os.urandom(2 * PART + 3))
    _replace_after_first_get(monkeypatch, store, "big", times=REREADS)
    with pytest.raises(ObjectChanged, match="3 times"):
        store.get_into("big", bytearray(3 * PART))
