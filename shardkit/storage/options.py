"""Storage options: what s3fs and boto3 are given for a URL, from explicit ``storage_options``
and the standard AWS environment variables, and how a store's location is printed."""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

from shardkit.errors import ConfigError
from shardkit.storage.urls import redact_url

__all__ = ["check_storage_options", "s3_options", "with_env_location", "boto_settings", "endpoint_of"]

_S3_CONNECT_TIMEOUT = 5
# Seconds without a byte before a read counts as a stalled connection (then retried). AWS's
# default is 60; with botocore's, s3fs's and shardkit's retries stacked, a frozen server took
# ~12 minutes to fail, in silence.
_S3_READ_TIMEOUT = 20

# storage_options keys whose meaning we reproduce exactly for boto3; anything else -> fsspec.
_BOTO_OPTION_KEYS = frozenset({"key", "secret", "token", "anon", "client_kwargs", "config_kwargs", "endpoint_url",
                               "profile", "s3_additional_kwargs", "skip_instance_cache", "use_listings_cache",
                               "default_block_size", "default_fill_cache", "default_cache_type", "asynchronous",
                               "loop", "version_aware", "listings_expiry_time", "max_concurrency"})
_GET_EXTRA_KEYS = ("RequestPayer", "SSECustomerAlgorithm", "SSECustomerKey", "SSECustomerKeyMD5", "ExpectedBucketOwner")

# boto3's spellings that s3fs takes under another name: the usual mistake.
_S3FS_SPELLING = {
    "aws_access_key_id": "'key'",
    "aws_secret_access_key": "'secret'",
    "aws_session_token": "'token'",
    "region_name": "client_kwargs={'region_name': ...}",
    "region": "client_kwargs={'region_name': ...}",
    "endpoint": "'endpoint_url' (or client_kwargs={'endpoint_url': ...})",
    "profile_name": "'profile'",
}


@functools.lru_cache(maxsize=1)
def _s3fs_keys() -> frozenset[str] | None:
    """The keyword arguments ``s3fs.S3FileSystem(...)`` takes, or None without s3fs.

    Its own parameters, fsspec's listings cache and instance cache options, and what it hands
    on to ``aiobotocore.session.AioSession`` (``profile``...): anything else reaches that
    session and fails there, far from the option that caused it.
    """
    try:  # here, not at the top: s3fs and aiobotocore are heavy, and only s3:// stores need them
        import fsspec.dircache
        import s3fs
        from aiobotocore.session import AioSession
    except ImportError:
        return None
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    keys = {"skip_instance_cache"}  # fsspec's _Cached takes it before any __init__
    for fn in (s3fs.S3FileSystem.__init__, AioSession.__init__, fsspec.dircache.DirCache.__init__):
        keys |= {p.name for p in inspect.signature(fn).parameters.values() if p.kind in named}
    keys.discard("self")
    return frozenset(keys)


def check_storage_options(url: str, options: dict[str, Any] | None) -> None:
    """Refuse ``storage_options`` keys s3fs does not take, for an ``s3://`` (``s3a://``) URL.

    s3fs hands unknown keys to its botocore session, which fails on first use with
    ``TypeError: AioSession.__init__() got an unexpected keyword argument``, wrapped in a
    storage error. Other protocols' options pass through unchecked.

    Args:
        url: the store's URL.
        options: the storage options given (values are never printed).

    Raises:
        ConfigError: a key s3fs does not take, named with the s3fs spelling when there is one.
    """
    if not options or not url.startswith(("s3://", "s3a://")):
        return
    known = _s3fs_keys()
    if known is None:
        return  # no s3fs: opening the store says so
    for name in options:
        if name in known:
            continue
        hint = _S3FS_SPELLING.get(name)
        advice = f"use {hint} instead" if hint else "s3fs takes " + ", ".join(sorted(known))
        raise ConfigError(f"storage_options: {name!r} is not an s3fs option (for {redact_url(url)}); {advice}")


def s3_options(explicit: dict[str, Any] | None) -> dict[str, Any]:
    """The s3fs options for a store: explicit storage options win, then the standard AWS variables.

    Args:
        explicit: the ``storage_options`` a user gave (nested dicts are merged key by key).

    Returns:
        Options with the endpoint and region of ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` and
        ``AWS_REGION``/``AWS_DEFAULT_REGION`` in ``client_kwargs``, and shardkit's timeouts.
    """
    opts: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs: dict[str, Any] = {}
    if endpoint:
        client_kwargs["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs["region_name"] = region
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    # Short connect timeout so a wrong endpoint fails in seconds, not minutes.
    opts["config_kwargs"] = {
        "connect_timeout": _S3_CONNECT_TIMEOUT,
        "read_timeout": _S3_READ_TIMEOUT,
        # One try per botocore call (its "max_attempts" counts retries, not tries: 2 meant 3):
        # shardkit's retry loops (and s3fs's, store.S3FS_RETRIES) retry, resume from the byte
        # reached, and say when the store stalls.
        "retries": {"total_max_attempts": 1, "mode": "standard"},
    }
    for name, value in (explicit or {}).items():
        if isinstance(value, dict) and isinstance(opts.get(name), dict):
            opts[name] = {**opts[name], **value}
        else:
            opts[name] = value
    return opts


def with_env_location(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus the S3 endpoint and region this process's environment gives.

    What a process elsewhere (a Ray worker with another environment) must use to reach the
    same store. Explicit options still win. Never the keys: those come from the other
    process's own environment, or from ``options`` as given.

    Args:
        url: the store's URL (only ``s3://`` and ``s3a://`` URLs get anything added).
        options: the storage options given.

    Returns:
        A new dict; ``options`` itself is not changed.
    """
    if not url.startswith(("s3://", "s3a://")) or "endpoint_url" in options:
        return dict(options)
    here = s3_options(None).get("client_kwargs") or {}
    if not here:
        return dict(options)
    return {**options, "client_kwargs": {**here, **(options.get("client_kwargs") or {})}}


def endpoint_of(url: str, options: dict[str, Any]) -> str:
    """A printable description of where ``url`` lives (its endpoint, never keys).

    Args:
        url: the store's URL.
        options: its resolved options (:func:`s3_options`).

    Returns:
        ``url``, plus the endpoint for ``s3://`` URLs, userinfo replaced by ``***``.
    """
    if url.startswith("s3://"):
        ep = (options.get("client_kwargs") or {}).get("endpoint_url") or options.get("endpoint_url")
        return f"{url} (endpoint {redact_url(str(ep)) if ep else 'AWS default'})"
    return url


def boto_settings(storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """What boto3 needs to reach the same bucket as a :class:`~shardkit.storage.store.Store`.

    Args:
        storage_options: the store's options, as given.

    Returns:
        ``client_kwargs``, ``config_kwargs``, ``key``, ``secret``, ``token``, ``anon``,
        ``profile`` and ``get_extra`` (extra ``get_object`` arguments); None when the options
        hold an s3fs option boto3 cannot mirror exactly (then stay with s3fs rather than guess).
    """
    opts = s3_options(storage_options)
    if set(opts) - _BOTO_OPTION_KEYS:
        return None
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if opts.get("endpoint_url"):
        client_kwargs.setdefault("endpoint_url", opts["endpoint_url"])
    extra = {k: v for k, v in (opts.get("s3_additional_kwargs") or {}).items() if k in _GET_EXTRA_KEYS}
    return {
        "client_kwargs": client_kwargs,
        "config_kwargs": dict(opts.get("config_kwargs") or {}),
        "key": opts.get("key"),
        "secret": opts.get("secret"),
        "token": opts.get("token"),
        "anon": bool(opts.get("anon")),
        "profile": opts.get("profile"),
        "get_extra": extra,
    }
