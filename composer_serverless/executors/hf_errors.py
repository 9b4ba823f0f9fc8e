"""What the Hugging Face Hub's refusals mean for a user of HF Jobs: the cause, the fix, and whether to retry.

``huggingface_hub`` raises ``HfHubHTTPError`` (its ``response`` carries the status and the headers) for an
answer it did not like, and its HTTP library's transport errors (``httpx`` up to 1.x, ``httpx2`` from 2.0)
for a request that got no answer. ``run_job``, ``inspect_job`` and ``cancel_job`` do not retry by
themselves; the listing does, a few times, inside each of our attempts.
"""

from __future__ import annotations

import importlib

from composer_serverless.executors.retrying import Refusal, retry_after_s

TOKEN_FIX = (
    "`hf auth login`, or export HF_TOKEN=<a valid token> (https://huggingface.co/settings/tokens); a "
    "fine-grained token needs the Jobs permission"
)


def transport_errors() -> tuple[type[BaseException], ...]:
    found = []
    for module in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _unsent_errors() -> tuple[type[BaseException], ...]:
    found = []
    for module in ("httpx", "httpx2"):
        try:
            http = importlib.import_module(module)
            found += [http.ConnectError, http.ConnectTimeout, http.PoolTimeout]
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def nothing_done(error: Exception) -> bool:
    """Whether a failed request certainly did nothing on the server: no connection was made (refused, a name
    that does not resolve, a connect or pool timeout), or the rate limiter refused it (429). After any other
    failure (no answer in time, a dropped connection, a 5xx) the server may have carried it out."""
    return _status_of(error) == 429 or isinstance(error, _unsent_errors())


def is_gone(error: Exception) -> bool:
    """An answer to a request about one job that means the job has ended or no longer exists: 404, or
    another 4xx that is not about the caller (cancelling a job that already ended is refused with one)."""
    status = _status_of(error)
    return status is not None and 400 <= status < 500 and status not in (401, 402, 403, 429)


def classify(
    error: Exception, what: str, namespace: str | None, endpoint: str, job: str | None = None
) -> Refusal | None:
    """The ``Refusal`` a Hub client error means while doing ``what``; None for an error that is not the API's.

    ``namespace`` (the user or organisation the jobs run under) is named in the messages where it is the
    thing to fix. ``job`` is the job a request about one job names (its log): a 404 then says the Hub does
    not know that job, since the namespace is the one the job was created in; a 404 to a request about the
    namespace's jobs (listing, creating) says it does not know the namespace.
    """
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    ns = f"namespace {namespace!r}" if namespace else "your namespace"
    if isinstance(error, LocalTokenNotFoundError):
        return Refusal(f"no Hugging Face token while {what}\n  fix: {TOKEN_FIX}", transient=False)
    if isinstance(error, HfHubHTTPError) and getattr(error, "response", None) is not None:
        status = error.response.status_code
        said = f": {error.server_message}" if getattr(error, "server_message", None) else ""
        if status == 401:
            return Refusal(
                f"the Hugging Face Hub rejected the token while {what} (HTTP 401{said})\n  fix: {TOKEN_FIX}",
                transient=False,
            )
        if status == 402:
            return Refusal(
                f"HF Jobs refused {what}: payment required (HTTP 402{said}); {ns} has no credits or payment "
                "method for Jobs\n  fix: add credits at https://huggingface.co/settings/billing (an "
                "organisation's on its own billing page), or set executor.namespace to one that pays",
                transient=False,
            )
        if status == 403:
            return Refusal(
                f"the token may not use HF Jobs in {ns} while {what} (HTTP 403{said})\n  fix: a token with "
                "the Jobs permission for that namespace (or membership of the organisation), or "
                "executor.namespace set to your own user",
                transient=False,
            )
        if status == 404 and job is not None:
            return Refusal(
                f"HF Jobs does not know job {job} in {ns} (HTTP 404{said}) while {what}: it no longer exists "
                "there, or never did\n  fix: `composer-serverless status RUN` shows what became of the replica; "
                "a job the Hub does not know has no log to read",
                transient=False,
            )
        if status == 404:
            return Refusal(
                f"HF Jobs does not know {ns} (HTTP 404{said}) while {what}\n  fix: set executor.namespace "
                "to an existing user or organisation, or leave it unset for your own",
                transient=False,
            )
        if status == 429:
            return Refusal(
                f"the Hub is rate-limiting this token (HTTP 429) while {what}\n  fix: wait a few minutes and "
                "run the command again; the replicas themselves are not affected",
                transient=True,
                retry_after_s=retry_after_s(error.response.headers.get("retry-after")),
            )
        if status >= 500:
            return Refusal(
                f"the Hub failed (HTTP {status}{said}) while {what}\n  fix: try again in a few minutes "
                "(https://status.huggingface.co)",
                transient=True,
                retry_after_s=retry_after_s(error.response.headers.get("retry-after")),
            )
        return Refusal(
            f"HF Jobs refused {what} (HTTP {status}{said})\n  fix: check executor.image, executor.flavor and "
            "executor.timeout_s against what the Hub accepts",
            transient=False,
        )
    if isinstance(error, transport_errors()):
        return Refusal(
            f"cannot reach the Hub at {endpoint} while {what} ({type(error).__name__}: {error})\n  fix: check "
            "this machine's network (and HF_ENDPOINT, if you set it), then run the command again",
            transient=True,
        )
    return None


def _status_of(error: Exception) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)
