"""What a cloud replica needs from the launcher's machine: a store it can reach, credentials, settings.

Cloud replicas share nothing with the launcher but the store and what the launcher hands them at launch.
So before anything is started we check that the store is one they can reach (not a local directory) and
which credentials they need; credentials travel by *name* (the backend reads the value from this environment
at launch and delivers it as a secret), settings such as the S3 region or endpoint travel as plain
environment variables.
"""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

import fsspec

from composer_serverless.config import ConfigError, RunConfig
from composer_serverless.executors.pricing import check_timeout_covers_work
from composer_serverless.rendezvous import runkey

# Credentials each store protocol needs in the replicas, and optional ones forwarded when present.
STORE_CREDENTIALS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "s3": (("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"), ("AWS_SESSION_TOKEN",)),
    "hf": (("HF_TOKEN",), ()),
}
# Non-secret settings the S3 clients read; forwarded so replicas reach the same endpoint and region.
FORWARDED_SETTINGS = ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
LOCAL_PROTOCOLS = frozenset({"file", "local", "memory"})
# Every replica's environment: unbuffered output (its log is read while it runs), tokenizers without a thread
# pool of their own (the replica's threads are sized by the executor).
REPLICA_ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
_LOGIN_HINT = " (or run `hf auth login`)"
# RFC 6598's shared address space (carrier-grade NAT, Tailscale): private, though not ``is_private``.
_SHARED_SPACE = ipaddress.ip_network("100.64.0.0/10")


def store_protocol(url: str) -> str:
    """The fsspec protocol of ``url`` (``file`` for a plain path), normalised (``s3a`` -> ``s3``)."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    return {"s3a": "s3", "gs": "gcs"}.get(protocol, protocol)


def check_reachable_by_cloud_replicas(config: RunConfig, executor: str) -> None:
    """Refuse what replicas in the cloud could never read: a local store, or a store endpoint on this machine
    or a private network (a model directory on this machine is shipped to them: ``shipment.py``)."""
    protocol = store_protocol(config.store)
    if protocol in LOCAL_PROTOCOLS:
        raise ConfigError(
            f"store {config.store!r} is on this machine, but {executor} replicas run elsewhere and could not "
            "reach it\n  fix: --set store=s3://<bucket>/runs (or any object store both can reach), "
            "or --executor local"
        )
    if not getattr(config.executor, "private_store_endpoint", False):
        for name, url in forwarded_settings().items():
            where = private_host(url) if name.startswith("AWS_ENDPOINT_URL") else None
            if where is not None:
                raise ConfigError(
                    f"{name}={url} points the replicas at {where}, which {executor} replicas cannot reach: "
                    "they run in someone else's data centre, where this address is their own machine or "
                    "nothing\n  fix: use an endpoint reachable from the internet (or unset "
                    f"{name} for AWS S3); if the replicas really reach it (a tunnel), "
                    "--set executor.private_store_endpoint=true"
                )


def check_cloud_plan(config: RunConfig, backend: str, at_once: str) -> None:
    """What a paid backend refuses before it plans anything: a store or model its replicas could not reach,
    more replicas than ``executor.max_replicas`` (``at_once`` says what they would hold, e.g. "8 H100 GPUs"),
    or a timeout shorter than the configured work.

    Raises:
        ConfigError: naming the key to change.
    """
    replicas = config.diloco.replicas
    check_reachable_by_cloud_replicas(config, backend)
    if replicas > config.executor.max_replicas:
        raise ConfigError(
            f"diloco.replicas ({replicas}) exceeds executor.max_replicas ({config.executor.max_replicas}): "
            f"{at_once} at once\n"
            f"  fix: fewer replicas, or --set executor.max_replicas={replicas} to pay for them"
        )
    check_timeout_covers_work(config)


def cloud_env() -> dict[str, str]:
    """The non-secret environment of a cloud replica: ``REPLICA_ENV`` and the S3 settings set here."""
    return {**REPLICA_ENV, **forwarded_settings()}


def secret_names(config: RunConfig, always: tuple[str, ...] = ()) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) environment variable names delivered to the replicas as secrets; with
    ``diloco.authenticate``, the run key's among them."""
    required, optional = STORE_CREDENTIALS.get(store_protocol(config.store), ((), ()))
    extra = getattr(config.executor, "secrets", ())
    made = (runkey.ENV,) if config.diloco.authenticate else ()
    required_all = tuple(dict.fromkeys((*always, *required, *extra, *made)))
    return required_all, tuple(n for n in optional if n not in required_all)


def present_secrets(config: RunConfig, always: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The secret names to deliver: every required one and the optional ones that are set here."""
    required, optional = secret_names(config, always)
    return (*required, *(n for n in optional if secret_value(n)))


def secret_name_problems(names: tuple[str, ...]) -> list[str]:
    """One problem line per secret the replicas need whose value is not available here (the run key is
    made by the launcher itself, so it is never one)."""
    return [
        f"{name} is not set: the replicas need it as a secret (to reach the store or the Hub)\n"
        f"  fix: export {name}=... in the shell that launches{_LOGIN_HINT if name == 'HF_TOKEN' else ''}"
        for name in names
        if name not in LAUNCHER_SECRETS and not secret_value(name)
    ]


# Secrets the launcher makes for a run (not read from this environment): given to the executor that
# launches the run's replicas (``run_secrets``), never written anywhere the plan or the store can show them.
LAUNCHER_SECRETS = (runkey.ENV,)


def launch_secrets(names: tuple[str, ...], run_secrets: dict[str, str]) -> dict[str, str]:
    """The values to deliver for secret ``names``: the run's own (the run key), else this environment's."""
    return {name: value for name in names if (value := run_secrets.get(name) or secret_value(name))}


def secret_value(name: str) -> str | None:
    """The value to deliver for secret ``name``: the environment's, or for HF_TOKEN the logged-in token."""
    value = os.environ.get(name)
    if value or name != "HF_TOKEN":
        return value or None
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token()


def private_host(url: str) -> str | None:
    """What makes ``url``'s host unreachable from another network ("loopback", "a private address", ...), or
    None. Names are not resolved (a plan touches no network): a literal address or a localhost name is."""
    host = (urlsplit(url if "://" in url else f"//{url}").hostname or "").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return f"loopback ({host})"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if address.is_loopback:
        return f"loopback ({host})"
    if address.is_link_local:
        return f"a link-local address ({host})"
    if address.is_private or address.is_reserved or address.is_unspecified or address in _SHARED_SPACE:
        return f"a private address ({host})"
    return None


def forwarded_settings() -> dict[str, str]:
    """The non-secret S3 settings set here, passed to replicas as plain environment variables."""
    return {name: os.environ[name] for name in FORWARDED_SETTINGS if os.environ.get(name)}


def teacher_key_names(config: RunConfig) -> list[str]:
    """The environment variables holding the harvest teachers' keys: the launcher's alone, never a replica's."""
    if config.harvest is None:
        return []
    return sorted({t.api_key_env for t in config.harvest.teachers if t.api_key_env})
