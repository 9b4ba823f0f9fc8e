"""When a failed store request is worth retrying, and how patiently.

Transient failures (5xx, throttling, timeouts, dropped connections, S3's 409 on concurrent conditional writes)
are retried with jittered exponential backoff; a missing object, a lost create race or a denied request is an
answer, not a fault, and is never retried. On S3 this is the only retry layer (botocore's and s3fs's are
turned off in ``store.py``), so attempts do not multiply.
"""

from __future__ import annotations

import errno
import random
from dataclasses import dataclass

# S3 error codes that mean "try again": throttling, server trouble, and the 409 S3 returns when two
# conditional writes to one key race (the loser of the race gets 412 once the winner has landed).
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "ConditionalRequestConflict",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EBUSY,
        errno.EAGAIN,
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.EINTR,
    }
    | ({errno.EREMOTEIO} if hasattr(errno, "EREMOTEIO") else set())
)


def is_transient(error: BaseException) -> bool:
    """True for failures a retry can fix: timeouts, dropped connections, 5xx, throttling, S3's 409.

    s3fs turns botocore errors into OSErrors but keeps the original as ``__cause__``; the S3 error code
    there is the reliable signal, so it is checked first. A missing object, an existing one (a lost
    create race, 412) or a denied request (403) is an answer, not a fault.
    """
    if isinstance(
        error, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
    ):
        return False
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = str(response["Error"].get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code in _TRANSIENT_CODES or status >= 500 or status == 429
        # Only explicit causes (``raise ... from``, as s3fs does): an implicit __context__ is whatever was
        # being handled when this error happened, not what this error is.
        cause = cause.__cause__
    if isinstance(error, (TimeoutError, ConnectionError, *_connection_errors())):
        return True
    return isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS


def _connection_errors() -> tuple[type[BaseException], ...]:
    """Failures below the HTTP layer (no response at all) in the S3 client stack, when it is installed:
    endpoint unreachable, connection dropped, read timeouts, truncated bodies."""
    errors: list[type[BaseException]] = []
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError

        errors += [BotoConnectionError, HTTPClientError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientConnectionError, ClientPayloadError

        errors += [ClientConnectionError, ClientPayloadError]
    except ImportError:
        pass
    return tuple(errors)


# A store that refuses writes for a while: full, read-only, over quota, access briefly revoked.
_UNWRITABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def is_unwritable(error: BaseException) -> bool:
    """True for a write the store refused because it cannot take writes now (a full or read-only
    filesystem, a quota, a revoked permission): an outage if it passes, a configuration error if it does not,
    which only the time it lasts tells apart (``RetryPolicy.outage_s``)."""
    return isinstance(error, OSError) and (
        error.errno in _UNWRITABLE_ERRNOS or isinstance(error, PermissionError)
    )


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a transient failure, and how long to keep retrying a write the
    store refuses (``outage_s``; 0 fails at once, as a launcher probing a new store wants).

    AWS advises retrying small requests after about 2 s and then backing off; the jitter keeps N replicas
    that failed together from retrying together. Through an outage writes are retried every ``outage_poll_s``
    at most, so a quorum forms within about that once the store is back.
    """

    attempts: int = 6
    first_s: float = 0.25
    cap_s: float = 8.0
    outage_s: float = 0.0
    outage_poll_s: float = 1.0

    def delay_s(self, attempt: int) -> float:
        return min(self.cap_s, self.first_s * 2**attempt) * (0.5 + random.random())

    def outage_delay_s(self, attempt: int) -> float:
        return min(self.outage_poll_s, self.first_s * 2**attempt) * (0.5 + random.random())
