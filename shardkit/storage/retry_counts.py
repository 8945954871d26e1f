"""Storage retries counted by kind, per process: what a stream's statistics and the Prometheus
exporter (:mod:`shardkit.datasets.metrics`) report as ``retries_<kind>``.

Every retry of a storage call goes through
:func:`~shardkit.storage.retry.pause_before_retry`, which counts it here. The counts are of the
whole process (its prefetch and read-ahead threads included); a reader reports the difference
over the time it read.
"""

from __future__ import annotations

import errno
import threading

__all__ = ["RETRY_KINDS", "count_retry", "retry_counts", "retry_kind"]

#: The kinds a retried fault is counted under.
RETRY_KINDS = ("reset", "short", "timeout", "connect", "throttle", "server", "other")

_counts = dict.fromkeys(RETRY_KINDS, 0)
_mu = threading.Lock()

_CONNECT = ("EndpointConnectionError", "Could not connect to the endpoint", "ClientConnectorError",
            "Cannot connect to host")
_SHORT = ("ShortRead", "IncompleteRead", "ContentLength", "ResponseStreamingError", "ClientPayloadError",
          "InvalidRange")
_THROTTLE = ("SlowDown", "503", "ServiceUnavailable", "TooManyRequests", "429")
_SERVER = ("InternalError", "500", "502", "504")
_RESET = ("reset by peer", "Connection", "ServerDisconnected", "BrokenPipe")


def retry_kind(exc: BaseException) -> str:
    """The kind of a retried storage fault.

    Args:
        exc: the fault.

    Returns:
        One of :data:`RETRY_KINDS`: ``timeout`` (no answer in time), ``connect`` (no
        connection at all), ``short`` (a body that ended early), ``throttle`` (503 SlowDown),
        ``server`` (other 5xx), ``reset`` (a connection dropped) or ``other``.
    """
    text = f"{type(exc).__name__} {exc}"
    if isinstance(exc, TimeoutError) or "Timeout" in text or "timed out" in text:
        return "timeout"
    if any(m in text for m in _CONNECT) or (
            isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)):
        return "connect"
    if any(m in text for m in _SHORT):
        return "short"
    if any(m in text for m in _THROTTLE):
        return "throttle"
    if any(m in text for m in _SERVER):
        return "server"
    if isinstance(exc, ConnectionError) or any(m in text for m in _RESET) or (
            isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)):
        return "reset"
    return "other"


def count_retry(exc: BaseException) -> None:
    """Count one retry of ``exc``'s kind.

    Args:
        exc: the fault about to be retried.
    """
    kind = retry_kind(exc)
    with _mu:
        _counts[kind] += 1


def retry_counts() -> dict[str, int]:
    """This process's retries so far.

    Returns:
        Kind -> retries, every kind of :data:`RETRY_KINDS` present.
    """
    with _mu:
        return dict(_counts)
