"""boto3 S3 clients built from a store's options: the one module that imports boto3.

Plain boto3 streams a GET faster than s3fs (see benchmarks/RESULTS.md), so bulk reads and
uploads use a client configured exactly as the store's s3fs filesystem would be.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import threading
from typing import Any

from shardkit.errors import ConfigError
from shardkit.storage.options import boto_settings

__all__ = ["s3_client", "have_boto3"]

_clients: dict[tuple[int, str], Any] = {}
_clients_mu = threading.Lock()
# botocore's data loader, kept across forks: a session given the loader of an earlier one reuses
# the service models it parsed, and its first client costs a fraction of the process's first one
# (which every DataLoader worker's first request would otherwise pay). Each client still gets a
# session of its own (credentials are resolved anew); _make_mu keeps the loader to one thread
# at a time.
_loader: list[Any] = []
_make_mu = threading.Lock()


def _after_fork() -> None:
    global _make_mu
    _make_mu = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)


@functools.lru_cache(maxsize=1)
def have_boto3() -> bool:
    """Whether boto3 can be imported here (checked without importing it).

    Returns:
        True when boto3 is installed.
    """
    return importlib.util.find_spec("boto3") is not None


def s3_client(storage_options: dict[str, Any] | None = None, max_pool: int = 8) -> Any:
    """A boto3 S3 client configured like :class:`~shardkit.storage.store.Store` would configure s3fs.

    Explicit ``storage_options`` win (``key``/``secret``/``token``, ``client_kwargs``
    ``endpoint_url``/``region_name``, ``config_kwargs``, ``anon``, ``profile``), then
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``/``AWS_REGION`` (via
    :func:`~shardkit.storage.options.s3_options`), then boto3's own chain (environment keys, config
    files). One client per process and settings (clients are thread-safe; a forked child
    builds its own, from the session its parent kept). Secrets are never logged: the cache key
    is a digest.

    Args:
        storage_options: the store's options, as given.
        max_pool: connections the client keeps for parallel requests (at least this many + 2).

    Returns:
        A ``botocore`` S3 client.

    Raises:
        ConfigError: the options hold something boto3 cannot mirror (use the fsspec transport).
    """
    settings = boto_settings(storage_options)
    if settings is None:
        raise ConfigError("storage_options: holds s3fs options the boto3 transport does not mirror; use transport='fsspec'")
    ident = hashlib.sha256(json.dumps([settings, max_pool], sort_keys=True, default=repr).encode()).hexdigest()
    cache_key = (os.getpid(), ident)
    with _clients_mu:
        client = _clients.get(cache_key)
        if client is not None:
            return client
    # Imported here, not at the top: `import shardkit` stays cheap for code that never reads S3.
    import boto3
    import botocore.session
    from botocore.config import Config

    cfg_kwargs = dict(settings["config_kwargs"])
    cfg_kwargs["max_pool_connections"] = max(int(cfg_kwargs.get("max_pool_connections", 10)), max_pool + 2)
    if settings["anon"]:
        from botocore import UNSIGNED
        cfg_kwargs["signature_version"] = UNSIGNED
    kwargs: dict[str, Any] = dict(settings["client_kwargs"])
    if settings["key"] and not settings["anon"]:
        kwargs.update(aws_access_key_id=settings["key"], aws_secret_access_key=settings["secret"],
                      aws_session_token=settings["token"])
    with _make_mu:
        core = botocore.session.Session(profile=settings["profile"] or None)
        if _loader:
            core.register_component("data_loader", _loader[0])
        else:
            _loader.append(core.get_component("data_loader"))
        client = boto3.session.Session(botocore_session=core).client("s3", config=Config(**cfg_kwargs), **kwargs)
    with _clients_mu:
        return _clients.setdefault(cache_key, client)
