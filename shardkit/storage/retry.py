"""Storage faults: which are worth retrying, how long to back off, and the one-line shardkit
error a fault becomes when the retries run out (naming the object, never a secret)."""

from __future__ import annotations

import errno
import logging
import random
import time
from typing import Callable, TypeVar

from shardkit.errors import ConfigError, ShardkitError, StorageError, StoragePermissionError, StorageStalledError, first_line
from shardkit.storage.retry_counts import count_retry

__all__ = [
    "RETRY_ATTEMPTS", "TIMEOUT_ATTEMPTS", "CONNECT_ATTEMPTS", "ShortRead", "is_short", "is_transient",
    "is_timeout", "is_connect_failure", "is_reset", "attempts_for", "pause_before_retry", "backoff_delay", "translate",
    "retrying",
]

T = TypeVar("T")
log = logging.getLogger(__name__)

RETRY_ATTEMPTS = 6
# Faults in a row after which a stall (each costs botocore's tries x the read timeout) is given
# up: a frozen store fails in about two minutes, warning at each retry.
TIMEOUT_ATTEMPTS = 3
# s3fs and botocore already retry a refused connect several times (~3 s) before it reaches us;
# retrying that RETRY_ATTEMPTS more times made a wrong endpoint take ~15 s per call. One more
# try covers a server restarting; a dead endpoint then fails in seconds.
CONNECT_ATTEMPTS = 2
_BACKOFF_BASE = 0.2
_BACKOFF_CAP = 5.0


class ShortRead(ConnectionError):
    """A body that ended before the range asked for: a dropped connection (retried), unless
    the object itself ends there (see :meth:`~shardkit.storage.store.Store.check_extent`)."""


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore ``ClientError`` (``"NoSuchKey"``, ``"403"``...), or None."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code")) or None
    return None


def is_short(exc: BaseException) -> bool:
    """Whether ``exc`` is a read that came back short, or a range the object does not reach (S3's 416).

    Args:
        exc: the fault.

    Returns:
        True for :class:`ShortRead` and S3's ``InvalidRange``.
    """
    return isinstance(exc, ShortRead) or _error_code(exc) in ("InvalidRange", "416")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: resets, timeouts, truncated bodies, 5xx and SlowDown.

    Args:
        exc: the fault.

    Returns:
        False for missing objects, denied access, shardkit errors and anything unknown.
    """
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, ShardkitError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)) or is_connect_failure(exc):
        return True  # a refused connection once more (a server restarting); attempts_for caps it
    # EREMOTEIO: s3fs's translation of a 5xx it got (500 InternalError), and of a response body it
    # could not parse (a listing's XML damaged in transit): both worth another try.
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE, errno.EIO, errno.EBUSY,
                                                  errno.EREMOTEIO):
        return True
    if _error_code(exc) in ("NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId",
                            "SignatureDoesNotMatch", "404", "403", "InvalidRange", "PreconditionFailed"):
        return False
    text = f"{type(exc).__name__} {exc}"
    markers = ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500", "502", "504",
               "Timeout", "timed out", "Connection", "IncompleteRead", "ResponseStreamingError",
               "ClientPayloadError", "ServerDisconnected", "reset by peer", "ContentLength",
               # botocore's response checksum caught bytes damaged in transit: read them again
               "FlexibleChecksumError")
    return any(m in text for m in markers)


def is_timeout(exc: BaseException) -> bool:
    """Whether the store accepted the request and then did not answer in time.

    Args:
        exc: the fault.

    Returns:
        True for ``TimeoutError`` and errors whose text says so.
    """
    text = f"{type(exc).__name__} {exc}"
    return isinstance(exc, TimeoutError) or "Timeout" in text or "timed out" in text


# What fails while connecting (refused, unreachable, unknown name), by class name, so that
# neither aiohttp nor urllib3 is imported here: aiohttp's ClientConnectorError (and its DNS,
# SSL and proxy kinds), urllib3's NewConnectionError (NameResolutionError) and socket.gaierror.
_CONNECT_STAGE = frozenset({"ClientConnectorError", "NewConnectionError", "gaierror", "ConnectionRefusedError"})
_NO_ROUTE = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)


def _wrapped(exc: BaseException) -> BaseException | None:
    """The transport's own error a botocore error wraps (its ``error`` argument), or None."""
    kwargs = getattr(exc, "kwargs", None)
    inner = kwargs.get("error") if isinstance(kwargs, dict) else None
    return inner if isinstance(inner, BaseException) else None


def is_connect_failure(exc: BaseException) -> bool:
    """Whether there was no connection to the store at all: refused, unreachable host, unknown
    name (botocore's EndpointConnectionError, aiohttp's ClientConnectorError for http(s):// and s3fs).

    A connection that was made and then reset or closed is not one, though aiobotocore (s3fs)
    wraps that in the same EndpointConnectionError as a refused connect: the error it wraps
    decides (an aiohttp ClientOSError "Connection reset by peer" is a reset, retried as long as
    any other transient fault).

    Args:
        exc: the fault.

    Returns:
        True when no request reached the store.
    """
    inner = _wrapped(exc)
    if inner is not None:
        return (bool(_CONNECT_STAGE & {c.__name__ for c in type(inner).__mro__})
                or isinstance(inner, OSError) and inner.errno in _NO_ROUTE)
    text = f"{type(exc).__name__} {exc}"
    if any(m in text for m in ("EndpointConnectionError", "Could not connect to the endpoint",
                               "ClientConnectorError", "Cannot connect to host")):
        return True
    return isinstance(exc, OSError) and exc.errno in _NO_ROUTE


def is_reset(exc: BaseException) -> bool:
    """Whether a connection the store had accepted was reset or closed before the answer ended.

    Args:
        exc: the fault.

    Returns:
        True for resets, broken pipes and dropped connections (also wrapped by botocore).
    """
    if is_connect_failure(exc):
        return False
    for e in (exc, _wrapped(exc)):
        if isinstance(e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
            return True
        if isinstance(e, OSError) and e.errno in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED):
            return True
    text = f"{type(exc).__name__} {exc} {_wrapped(exc)!r}"
    return any(m in text for m in ("reset by peer", "ConnectionClosedError", "ServerDisconnected",
                                   "Connection aborted", "EndpointConnectionError"))


def attempts_for(exc: BaseException, attempts: int = RETRY_ATTEMPTS) -> int:
    """Faults in a row worth trying through: fewer for a dead endpoint or a stalled store.

    Args:
        exc: the latest fault.
        attempts: the budget for ordinary faults.

    Returns:
        ``attempts``, or less for a connect failure or a timeout.
    """
    if is_connect_failure(exc):
        return min(attempts, CONNECT_ATTEMPTS)
    if is_timeout(exc):
        return min(attempts, TIMEOUT_ATTEMPTS)
    return attempts


def pause_before_retry(exc: BaseException, what: str, where: str, failures: int, attempts: int) -> None:
    """Sleep the backoff before retry number ``failures`` of ``what``.

    A stalled store is said at each retry (a frozen server otherwise looks like a hang);
    routine resets are logged at debug level only.

    Args:
        exc: the fault being retried.
        what: the object (relative path) the call was about.
        where: the store, as :attr:`~shardkit.storage.store.Store.where` prints it.
        failures: faults in a row so far.
        attempts: the budget :func:`attempts_for` gave.
    """
    count_retry(exc)  # retries by kind, for stream statistics and metrics
    if is_timeout(exc):
        log.warning("storage: no answer for %s at %s (%s); retrying (%d of %d)", what, where, type(exc).__name__,
                    failures, attempts - 1)
    else:
        log.debug("storage: %s on %s at %s; retrying (%d of %d)", type(exc).__name__, what, where, failures,
                  attempts - 1)
    time.sleep(backoff_delay(failures))


def backoff_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt``.

    Capped exponential backoff with full jitter, so the retries of many workers spread out.

    Args:
        attempt: 1 for the first retry.

    Returns:
        A random delay in ``[0, min(5, 0.2 * 2**attempt))``.
    """
    return random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt))


def translate(exc: BaseException, what: str, where: str) -> ShardkitError:
    """Map a backend error to a one-line shardkit error naming ``what``.

    Args:
        exc: the backend error (a shardkit error is returned as it is).
        what: the object (relative path) the call was about.
        where: the store, as :attr:`~shardkit.storage.store.Store.where` prints it.

    Returns:
        StorageError, StoragePermissionError or StorageStalledError (to raise ``from exc``).
    """
    if isinstance(exc, ShardkitError):
        return exc
    name = type(exc).__name__
    text = first_line(exc) or name
    code = _error_code(exc)
    if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
        return StorageError(f"{what} not found at {where} ({code})")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return StoragePermissionError(f"access denied to {what} at {where}: check credentials ({code})")
    if name == "NoCredentialsError":  # botocore: no key found in storage_options, AWS_* variables or profiles
        return StoragePermissionError(f"no credentials for {what} at {where}: set AWS_ACCESS_KEY_ID and "
                                      "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass key and secret in "
                                      "storage_options")
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return StoragePermissionError(f"access denied to {what} at {where}: check credentials ({text})")
    if isinstance(exc, FileNotFoundError):
        return StorageError(f"{what} not found at {where}")
    if is_reset(exc):
        return StorageError(f"storage reset the connection for {what} at {where} "
                            f"({type(_wrapped(exc) or exc).__name__}) on every try: "
                            "check the store's health and load, or the network to it")
    if is_connect_failure(exc) or isinstance(exc, ConnectionError):
        return StorageError(f"cannot reach storage for {what} at {where}: {name}")
    if is_timeout(exc):
        return StorageStalledError(f"storage did not answer for {what} at {where} ({name}), "
                                   f"retried {TIMEOUT_ATTEMPTS} times")
    return StorageError(f"storage error on {what} at {where}: {name}: {text}")


def retrying(fn: Callable[[], T], what: str, where: str, attempts: int = RETRY_ATTEMPTS) -> T:
    """Call ``fn``, retrying transient storage faults with backoff.

    Args:
        fn: the storage call.
        what: the object it is about (named by the error).
        where: the store, as :attr:`~shardkit.storage.store.Store.where` prints it.
        attempts: calls at most (fewer for a dead endpoint or a stalled store).

    Returns:
        What ``fn`` returned.

    Raises:
        ShardkitError: the last fault, translated (:func:`translate`); shardkit errors pass through.
        ConfigError: ``attempts`` is not positive.
    """
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised translated
            if isinstance(exc, ShardkitError):
                raise
            budget = attempts_for(exc, attempts)
            if attempt + 1 < budget and is_transient(exc):
                pause_before_retry(exc, what, where, attempt + 1, budget)
                continue
            raise translate(exc, what, where) from exc
    raise ConfigError(f"retrying {what}: attempts must be positive, got {attempts}")
