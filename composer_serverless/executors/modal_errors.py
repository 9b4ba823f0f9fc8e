"""What the Modal client's exceptions mean for a user: the cause, the fix, and whether to retry.

The client raises its own exception classes for what the API answered (all of them ``modal.exception``
gRPC wrappers: ``AuthError``, ``PermissionDeniedError``, ``ResourceExhaustedError``, ...) and
``modal.exception.ConnectionError`` once its own retries could not reach the server (about a minute).
A replica's own exception reaches the launcher as itself, re-raised by ``FunctionCall.get``, and is not the
API's: ``classify`` returns None for it.
"""

from __future__ import annotations

from composer_serverless.executors.retrying import Refusal

TOKEN_FIX = "`modal token new` (or export MODAL_TOKEN_ID and MODAL_TOKEN_SECRET of a valid token)"


def classify(error: Exception, what: str) -> Refusal | None:
    """The ``Refusal`` a Modal client error means while doing ``what``; None if it is not the API's."""
    from modal import exception as mx

    said = f"{type(error).__name__}: {error}"
    if isinstance(error, mx.AuthError):
        return Refusal(f"Modal rejected the token while {what} ({said})\n  fix: {TOKEN_FIX}", transient=False)
    if isinstance(error, mx.PermissionDeniedError):
        return Refusal(
            f"Modal denied the token permission while {what} ({said})\n  fix: a token of a workspace where you may run "
            "apps (`modal profile current` shows which one is used)",
            transient=False,
        )
    if isinstance(error, mx.ResourceExhaustedError):
        return Refusal(
            f"Modal is refusing requests for now while {what} ({said})\n  fix: wait a few minutes and run the "
            "command again; the replicas themselves are not affected",
            transient=True,
        )
    if isinstance(error, (mx.ConnectionError, mx.ServiceError, mx.InternalError)):
        return Refusal(
            f"cannot reach Modal while {what} ({said})\n  fix: check this machine's network "
            "(https://status.modal.com), then run the command again",
            transient=True,
        )
    return None
