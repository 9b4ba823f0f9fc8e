"""Moving objects the way object stores are fast: several requests at once, large objects in parallel parts.

A cloud store gives each connection roughly 50-150 MB/s and scales with parallel requests, so one replica
moving its shards one request at a time is capped at one connection's speed. Here a process moves up to
``Transfers.concurrency`` requests at once (threads: file and S3 I/O release the GIL) and, on S3, an object
larger than ``Transfers.part_bytes`` in parts: a multipart upload whose parts go up in parallel, and ranged
GETs that land in parallel in the caller's buffer. Every request holds one of the store's ``Slots`` while it
runs, whole object or part, so however objects and parts nest a process never has more than ``concurrency``
requests in flight. Listings, existence checks and deletes (the exchange's polls) take no slot, and on a
file store nothing does: there the threads of ``map`` are the only bound.

What the store guarantees survives the split:

* **Atomic put.** A multipart object appears only at ``CompleteMultipartUpload``; a failed upload is aborted,
  so no part lingers (and is billed).
* **Create-if-absent.** ``If-None-Match: *`` goes on ``CompleteMultipartUpload`` (honoured by S3 since
  2024 and by moto, checked by a test); a lost race raises ``FileExistsError`` as a single PUT's does.
* **Bounded retries per request.** Each part is retried on its own through the store's retry loop
  (``retry.py``), so a dropped connection costs a part, not the object.
* **One version per read.** Every ranged GET after the first carries ``If-Match`` with the first one's ETag:
  a reader never mixes two versions of an object that was replaced while it read. Such a read starts over
  (the object's newest version, checked by its reader like any other), ``REREADS`` times at most; an
  object that keeps changing raises ``ObjectChanged``.
* **The size guard.** The first ranged GET reports the object's size; one larger than the caller's buffer
  raises ``ObjectTooLarge`` before anything else is fetched.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
# What the store's retrying call looks like: (operation, key for logs and fault injection, one attempt).
Call = Callable[[str, str, Callable[[], Any]], Any]

logger = logging.getLogger(__name__)

# S3 refuses multipart parts under 5 MiB (but the last).
MIN_PART_BYTES = 5 << 20
_RANGE_TOTAL = re.compile(r"/(\d+)$")
# How many times a read that found its object replaced midway starts over.
REREADS = 3


@dataclass(frozen=True)
class Transfers:
    """How a process moves objects: up to ``concurrency`` requests at once; on S3, objects larger than
    ``part_bytes`` in parts of that size. The defaults are about those of AWS's own transfer manager
    (boto3's ``TransferConfig``: 10 threads, 8 MB parts): small enough that a model's shards split into
    several parts, and each part in flight costs its size in memory twice (a copy for the request)."""

    concurrency: int = 8
    part_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"transfer concurrency must be at least 1, got {self.concurrency}")
        if self.part_bytes < MIN_PART_BYTES:
            raise ValueError(
                f"a part must be at least {MIN_PART_BYTES} bytes (S3's minimum), got {self.part_bytes}"
            )


class ObjectChanged(OSError):
    """An object was replaced while it was read in parts, every time it was read."""


class Slots:
    """The requests a process may have in flight; shared by a store and every child made from it."""

    def __init__(self, count: int) -> None:
        self._semaphore = threading.BoundedSemaphore(count)

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._semaphore:
            yield


def run_all(tasks: list[Callable[[], T]], workers: int) -> list[T]:
    """Run ``tasks`` on up to ``workers`` threads and return their results in order. Every task finishes
    before this returns, failed or not (nothing is left writing behind the caller); the first failure, in
    task order, is then raised."""
    if workers <= 1 or len(tasks) <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(min(workers, len(tasks)), thread_name_prefix="store-transfer") as pool:
        futures = [pool.submit(task) for task in tasks]
        wait(futures)
    return [future.result() for future in futures]


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """[start, end) of the parts of an object of ``size`` bytes."""
    return [(start, min(size, start + part_bytes)) for start in range(0, size, part_bytes)]


class S3Parts:
    """The S3 requests of one store, whole or in parts, each holding a slot and retried on its own.

    Args:
        fs: the store's s3fs filesystem.
        transfers: concurrency and part size.
        slots: the store's request slots.
        call: the store's retrying call (``ObjectStore._call``).
        too_large: raised (path, size, capacity) when an object does not fit the caller's buffer.
    """

    def __init__(
        self,
        fs: Any,
        transfers: Transfers,
        slots: Slots,
        call: Call,
        too_large: Callable[[str, int, int], None],
    ) -> None:
        self._fs = fs
        self._transfers = transfers
        self._slots = slots
        self._call = call
        self._check_fits = too_large

    def _request(self, method: str, **kwargs: Any) -> Any:
        with self._slots.held():
            return _sync(self._fs, method, **kwargs)

    # --- writes ------------------------------------------------------------------------------------

    def put(self, path: str, key: str, data: list[Buffer], *, create: bool) -> None:
        """Write the concatenation of ``data`` at ``path``; with ``create``, only if it does not exist
        (``FileExistsError`` otherwise)."""
        bucket, name, _ = self._fs.split_path(path)
        size = sum(len(memoryview(d).cast("B")) for d in data)
        op = "create" if create else "put"
        match = {"IfNoneMatch": "*"} if create else {}
        if size <= self._transfers.part_bytes:
            whole = data[0] if len(data) == 1 else None
            # Joined once, not on every retry; a single bytes object goes as it is (botocore takes no view).
            body = whole if isinstance(whole, (bytes, bytearray)) else _slice(data, 0, size)
            self._call(
                op, key, lambda: self._request("put_object", Bucket=bucket, Key=name, Body=body, **match)
            )
            return
        upload = self._call(
            op, f"{key} start", lambda: self._request("create_multipart_upload", Bucket=bucket, Key=name)
        )
        upload_id = upload["UploadId"]
        try:
            ranges = part_ranges(size, self._transfers.part_bytes)

            def send(number: int, start: int, end: int) -> dict[str, Any]:
                def attempt() -> dict[str, Any]:
                    # The part's bytes are copied only while its request holds a slot: at most
                    # ``concurrency`` parts are in memory twice at once.
                    with self._slots.held():
                        body = _slice(data, start, end)
                        return _sync(
                            self._fs,
                            "upload_part",
                            Bucket=bucket,
                            Key=name,
                            UploadId=upload_id,
                            PartNumber=number,
                            Body=body,
                        )

                out = self._call(op, f"{key} part {number}", attempt)
                return {"PartNumber": number, "ETag": out["ETag"]}

            parts = run_all(
                [lambda n=n, a=a, b=b: send(n, a, b) for n, (a, b) in enumerate(ranges, start=1)],
                self._transfers.concurrency,
            )
            tries = 0

            def complete() -> None:
                nonlocal tries
                tries += 1
                try:
                    self._request(
                        "complete_multipart_upload",
                        Bucket=bucket,
                        Key=name,
                        UploadId=upload_id,
                        MultipartUpload={"Parts": parts},
                        **match,
                    )
                except FileNotFoundError:
                    if tries == 1:
                        raise
                    # NoSuchUpload on a retry: the first attempt completed the upload and its answer was
                    # lost. The object is there: a put is done, and create-if-absent reads it back to tell
                    # whose it is.
                    if create:
                        raise FileExistsError(path) from None

            self._call(op, f"{key} complete", complete)
        except BaseException:
            self._abort(bucket, name, upload_id)
            raise

    def _abort(self, bucket: str, name: str, upload_id: str) -> None:
        # The upload may be completed or gone already; a bucket lifecycle rule sweeps what an abort misses.
        with contextlib.suppress(Exception):
            self._request("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload_id)

    # --- reads -------------------------------------------------------------------------------------

    def read(self, path: str, key: str, view: memoryview | None) -> memoryview:
        """Read the object at ``path`` into ``view`` (or a new buffer of its size); returns the filled part.
        An object larger than one part arrives in parallel ranged GETs."""
        bucket, name, _ = self._fs.split_path(path)
        part = self._transfers.part_bytes
        if view is not None and len(view) <= part:  # nothing that fits is worth splitting
            out, size, _ = self._call("get", key, lambda: self._get(bucket, name, path, view, None))
            return out[:size]
        for _ in range(REREADS):
            out, size, etag = self._call("get", key, lambda: self._get(bucket, name, path, view, (0, part)))

            def fetch(start: int, end: int, out: memoryview = out, etag: str | None = etag) -> None:
                where = f"{key} bytes {start}"
                self._call("get", where, lambda: self._get(bucket, name, path, out, (start, end), etag))

            try:
                run_all(
                    [lambda a=a, b=b: fetch(a, b) for a, b in part_ranges(size, part)[1:]],
                    self._transfers.concurrency,
                )
            except OSError as e:
                if _code(e) != "PreconditionFailed":
                    raise
                logger.info("%s was replaced while it was read; reading it again", path)
                continue
            return out[:size]
        raise ObjectChanged(f"{path} was replaced while it was read, {REREADS} times in a row")

    def _get(
        self,
        bucket: str,
        name: str,
        path: str,
        view: memoryview | None,
        span: tuple[int, int] | None,
        etag: str | None = None,
    ) -> tuple[memoryview, int, str | None]:
        """One GET, of the whole object or of ``span``, streamed into ``view`` at the span's offset (a new
        buffer of the object's size if ``view`` is None). Returns the buffer, the object's size and ETag."""
        from fsspec.asyn import sync

        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": name}
        if span is not None:
            kwargs["Range"] = f"bytes={span[0]}-{span[1] - 1}"
        if etag is not None:
            kwargs["IfMatch"] = etag

        async def stream() -> tuple[memoryview, int, str | None]:
            try:
                response = await self._fs._call_s3("get_object", **kwargs)
            except OSError as e:
                if span is not None and span[0] == 0 and _code(e) == "InvalidRange":  # an empty object
                    return (memoryview(bytearray(0)) if view is None else view), 0, None
                raise
            body = response["Body"]
            try:
                length = int(response["ContentLength"])
                total = _RANGE_TOTAL.search(str(response.get("ContentRange") or ""))
                size = int(total.group(1)) if span is not None and total else length
                out = memoryview(bytearray(size)) if view is None else view
                self._check_fits(path, size, len(out))
                offset = 0 if span is None else span[0]
                done = 0
                while done < length:
                    chunk = await body.read(min(_STREAM_CHUNK, length - done))
                    if not chunk:
                        raise ConnectionResetError(f"{path}: body ended after {done} of {length} bytes")
                    out[offset + done : offset + done + len(chunk)] = chunk
                    done += len(chunk)
                return out, size, response.get("ETag")
            finally:
                body.close()

        with self._slots.held():
            return sync(self._fs.loop, stream)


_STREAM_CHUNK = 8 << 20


def _slice(data: list[Buffer], start: int, end: int) -> bytearray:
    """Bytes ``[start, end)`` of the concatenation of ``data`` (one copy; botocore takes no memoryview)."""
    out = bytearray(end - start)
    position = 0
    for buffer in data:
        view = memoryview(buffer).cast("B")
        a, b = max(start, position), min(end, position + len(view))
        if a < b:
            out[a - start : b - start] = view[a - position : b - position]
        position += len(view)
    return out


def _sync(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 call on the filesystem's event loop, from this thread."""
    from fsspec.asyn import sync

    return sync(fs.loop, fs._call_s3, method, **kwargs)


def _code(error: BaseException) -> str:
    """The S3 error code behind an s3fs error (kept as its ``__cause__``), or ''."""
    cause: BaseException | None = error
    while cause is not None:
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return str(response["Error"].get("Code", ""))
        cause = cause.__cause__
    return ""
