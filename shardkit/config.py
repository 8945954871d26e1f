"""Defaults, the ``SHARDKIT_*`` environment knobs, and option parsing (sizes like ``"512MB"``).

Explicit arguments always win over the environment; the environment is read when a function
is called, never at import time.
"""

from __future__ import annotations

import math
import operator
import os
import re

from shardkit.errors import ConfigError

__all__ = [
    "DEFAULT_SHARD_BYTES", "DEFAULT_TASK_BYTES", "ROOM_WAIT_SECONDS", "LANDING_BYTES", "KEEP_MAPS_BYTES",
    "parse_size", "int_arg", "env_bytes", "env_seconds", "room_wait", "landing_budget", "keep_maps_budget",
    "LOCK_WAIT_SECONDS", "LOCK_NOTE_SECONDS", "lock_wait",
    "human_bytes", "checked_cache_dir",
]

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
# A sign is read so that "-5MB" is refused as not positive rather than as no size at all.
_SIZE = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")

DEFAULT_SHARD_BYTES = 512 * 10**6
DEFAULT_TASK_BYTES = 2 * 10**9

# The SHARDKIT_* environment knobs, each with its default; read through the functions below,
# when called. Why each default is what it is lives beside the code that uses it.
ROOM_WAIT_ENV, ROOM_WAIT_SECONDS = "SHARDKIT_ROOM_WAIT", 5.0
LANDING_ENV, LANDING_BYTES = "SHARDKIT_LANDING_BYTES", 512 * 2**20
KEEP_MAPS_ENV, KEEP_MAPS_BYTES = "SHARDKIT_KEEP_MAPS", 16 * 2**30
LOCK_WAIT_ENV, LOCK_WAIT_SECONDS = "SHARDKIT_LOCK_WAIT", 30.0
LOCK_NOTE_SECONDS = 5.0  # a wait for a lock of the node cache is logged, with its holder, after this long


def parse_size(value: int | float | str, option: str) -> int:
    """Parse a size such as ``512MB`` (decimal), ``1.5GiB`` or ``2G`` (binary) or ``4096``.

    Args:
        value: the size: a number of bytes, or a number and a unit.
        option: the option's name, for the error message.

    Returns:
        The size in bytes.

    Raises:
        ConfigError: not a size, not finite (nan, inf), or not positive (names ``option``).
    """
    if isinstance(value, bool):
        raise ConfigError(f"{option}: expected a size like '512MB', got {value!r}")
    if isinstance(value, (int, float)):
        number = value
    else:
        m = _SIZE.match(str(value))
        unit = m.group(2).upper() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"{option}: expected a size like '512MB' or '2GiB', got {value!r}")
        number = float(m.group(1)) * _UNITS[unit]
    if isinstance(number, float) and not math.isfinite(number):  # int() would raise a bare ValueError/OverflowError
        raise ConfigError(f"{option}: expected a finite size like '512MB', got {value!r}")
    n = int(number)
    if n <= 0:
        raise ConfigError(f"{option}: size must be positive, got {value!r}")
    return n


def int_arg(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """Check an integer option, so ``"32"`` from an argument parser or ``2.5`` is said at once,
    under the name the caller used, not as a TypeError later.

    Args:
        name: the option's name, for the error message.
        value: the value given (numpy integers are accepted).
        minimum: the smallest value allowed.
        maximum: the largest value allowed, or None for no bound.

    Returns:
        ``value`` as an int.

    Raises:
        ConfigError: not an integer (bools are refused), or out of range.
    """
    # bool is an int subclass; True as a world size is a bug, not a 1.
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {number}")
    return number


def env_bytes(name: str, default: int) -> int:
    """A byte budget from an environment variable, read now.

    Args:
        name: the variable.
        default: the budget when it is unset or empty.

    Returns:
        The budget in bytes; ``0`` when the variable is ``0`` (the feature off).

    Raises:
        ConfigError: the variable is not a size (names it).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    return 0 if raw == "0" else parse_size(raw, name)


def env_seconds(name: str, default: float) -> float:
    """Seconds from an environment variable, read now.

    Args:
        name: the variable.
        default: the value when it is unset or empty.

    Returns:
        The number of seconds.

    Raises:
        ConfigError: the variable is not a number >= 0 (names it).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise ConfigError(f"{name}: expected seconds >= 0, got {raw!r}")
    return value


def room_wait() -> float:
    """Seconds a reader waits for cache room that other readers' open shards hold, before it
    reads the shard around the cache.

    Returns:
        ``SHARDKIT_ROOM_WAIT`` if set, else :data:`ROOM_WAIT_SECONDS`.

    Raises:
        ConfigError: the variable is not a number >= 0.
    """
    return env_seconds(ROOM_WAIT_ENV, ROOM_WAIT_SECONDS)


def lock_wait() -> float:
    """Seconds a reader waits for a lock of the node cache (a shard's download, the space
    accounting) that another process holds without progress (stopped with SIGSTOP, frozen),
    before it reads the shard around the cache. A holder that makes progress (its download
    grows, it uses CPU) is waited for: downloads end, storage retries are bounded.

    Returns:
        ``SHARDKIT_LOCK_WAIT`` if set, else :data:`LOCK_WAIT_SECONDS`.

    Raises:
        ConfigError: the variable is not a number >= 0.
    """
    return env_seconds(LOCK_WAIT_ENV, LOCK_WAIT_SECONDS)


def landing_budget() -> int:
    """Bytes of landing buffers (page-aligned fill buffers for cold shards) one process may hold.

    Returns:
        ``SHARDKIT_LANDING_BYTES`` if set (``0`` turns landing buffers off), else
        :data:`LANDING_BYTES`.

    Raises:
        ConfigError: the variable is not a size.
    """
    return env_bytes(LANDING_ENV, LANDING_BYTES)


def keep_maps_budget() -> int:
    """Bytes of cache files one process may keep mapped from one epoch to the next.

    Returns:
        ``SHARDKIT_KEEP_MAPS`` if set (``0`` turns keeping off), else :data:`KEEP_MAPS_BYTES`.

    Raises:
        ConfigError: the variable is not a size.
    """
    return env_bytes(KEEP_MAPS_ENV, KEEP_MAPS_BYTES)


def human_bytes(n: float) -> str:
    """A byte count for messages, in decimal units: ``512 B``, ``1.5 MB``, ``2.0 GB``.

    Args:
        n: the number of bytes.

    Returns:
        The count with one decimal and its unit.
    """
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def checked_cache_dir(cache_dir: str | os.PathLike[str] | None) -> str | None:
    """Check a ``cache_dir`` argument.

    Args:
        cache_dir: a directory on local disk, or None for no cache.

    Returns:
        The directory as a string, or None.

    Raises:
        ConfigError: an empty string, which would make the current directory the node cache.
    """
    if cache_dir is None:
        return None
    path = os.fsdecode(cache_dir)
    if not path.strip():
        raise ConfigError("cache_dir: empty; pass a directory on local disk (NVMe) or None to stream without a cache")
    return path
