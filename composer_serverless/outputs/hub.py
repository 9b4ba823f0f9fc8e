"""Pushing an exported model to the Hugging Face Hub, for ``export --push-to-hub`` and the launcher's push at
the end of a run (``[output]``).

The repo is created private unless asked otherwise. A repo that already exists keeps its visibility, so a
push asked to be private into an existing public repo is refused: it would publish the model. That, the
token and its right to write are checked (``check_access``) before the export writes anything, so a refusal
costs nothing. Every file goes in one commit (``create_commit``, not ``upload_folder``, which may split a
folder into several), so the repo holds the whole model or, after a failure, none of it.

The Hub's refusals become ``BackendError``: exit 2 for what the user must fix (the token, permissions, the
repo), 1 for what may pass (rate limits, server errors, the network). ``endpoint`` is huggingface_hub's own
``HfApi(endpoint=...)``: None is the Hub (or ``HF_ENDPOINT``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from huggingface_hub.utils import HFValidationError, disable_progress_bars, validate_repo_id

from composer_serverless.executors.base import BackendError
from composer_serverless.executors.hf_errors import transport_errors

logger = logging.getLogger(__name__)

TOKEN_FIX = (
    "export HF_TOKEN=<a token with write access> (https://huggingface.co/settings/tokens), or `hf auth login`"
)


def repo_problem(repo: str) -> str | None:
    """What is wrong with ``repo`` as a Hub repo id, by huggingface_hub's own rule; None if nothing."""
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        return f"{repo!r} is not a Hub repo id: {e}"
    return None


def check_access(token: str, repo: str, *, private: bool, endpoint: str | None = None) -> None:
    """Before anything is written: the Hub accepts ``token``, it may write (a read token may not), and a push
    asked to be ``private`` would not land in an existing public ``repo``.

    Raises:
        BackendError: what the Hub refused, or one of those is not so.
    """
    api = HfApi(endpoint=endpoint, token=token)
    try:
        role = api.whoami().get("auth", {}).get("accessToken", {}).get("role")
        if role == "read":
            raise BackendError(
                f"the Hugging Face token is a read token: it cannot push\n  fix: {TOKEN_FIX}", 2
            )
        try:
            public = not api.model_info(repo).private
        except RepositoryNotFoundError:
            public = False  # the push creates it
    except BackendError:
        raise
    except Exception as e:
        raise _said(e, f"checking the token and {repo}", api.endpoint) from None
    if private and public:
        raise BackendError(
            f"{repo} already exists and is public: pushing to it would publish the model\n  fix: choose a new "
            "repo, or push to this one anyway with --public (in a config: output.private = false)",
            2,
        )


def push(
    folder: Path, repo: str, *, private: bool, token: str, message: str, endpoint: str | None = None
) -> str:
    """Create ``repo`` (private if ``private``) unless it exists, and commit every file under ``folder`` to
    it at once; returns the commit's URL."""
    api = HfApi(endpoint=endpoint, token=token)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    operations = [CommitOperationAdd(p.relative_to(folder).as_posix(), str(p)) for p in files]
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        # Without huggingface_hub's bar per uploaded file between the command's lines (put back after).
        with disable_progress_bars():
            commit = api.create_commit(repo, operations, commit_message=message)
    except Exception as e:
        raise _said(e, f"pushing to {repo}", api.endpoint) from None
    logger.info("pushed %d files to %s: %s", len(files), repo, commit.commit_url)
    return commit.commit_url


def _said(error: Exception, what: str, endpoint: str) -> Exception:
    """The ``BackendError`` a failed Hub request means, said for the user; ``error`` itself if it is not one."""
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        said = f": {error.server_message}" if error.server_message else ""
        if status == 401:
            return BackendError(
                f"the Hugging Face Hub rejected the token while {what} (HTTP 401{said})\n  fix: {TOKEN_FIX}",
                2,
            )
        if status == 403:
            return BackendError(
                f"the token may not write there while {what} (HTTP 403{said})\n  fix: a token with write "
                "access to that user or organisation (a fine-grained token needs it for the repo)",
                2,
            )
        if status == 429 or status >= 500:
            return BackendError(
                f"the Hub failed (HTTP {status}{said}) while {what}\n  fix: try again in a few minutes "
                "(https://status.huggingface.co)",
                1,
            )
        return BackendError(f"the Hub refused {what} (HTTP {status}{said})", 2)
    if isinstance(error, transport_errors()):
        return BackendError(
            f"cannot reach the Hub at {endpoint} while {what} ({type(error).__name__}: {error})\n  fix: check "
            "this machine's network (and HF_ENDPOINT, if you set it), then try again",
            1,
        )
    return error
