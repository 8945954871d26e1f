"""Option parsing: sizes like ``"512MB"``, and defaults.

Explicit arguments always win over the environment; the environment is read when a function
is called, never at import time.
"""

from __future__ import annotations

import operator
import os
import re

from .errors import ConfigError

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


def parse_size(value: int | float | str, option: str) -> int:
    """Parse ``512MB``, ``1.5GiB``, ``4096`` into bytes; ConfigError naming ``option`` if bad."""
    if isinstance(value, bool):
        raise ConfigError(f"{option}: expected a size like '512MB', got {value!r}")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = _SIZE.match(str(value))
        unit = m.group(2).upper() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"{option}: expected a size like '512MB' or '2GiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"{option}: size must be positive, got {value!r}")
    return n


def int_arg(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (numpy integers too), else a one-line
    ConfigError naming ``name`` and the value: ``"32"`` from an argument parser or ``2.5``
    said here, not as a TypeError (or in a name the caller never used) later."""
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
    """A byte budget from environment variable ``name`` (read now): unset or empty gives
    ``default``, ``0`` turns the feature off, anything else is a size (ConfigError naming it)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    return 0 if raw == "0" else parse_size(raw, name)


def env_seconds(name: str, default: float) -> float:
    """Seconds from environment variable ``name`` (read now): unset or empty gives
    ``default``; ConfigError naming it unless a number >= 0."""
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


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def checked_cache_dir(cache_dir: str | os.PathLike[str] | None) -> str | None:
    """``cache_dir`` as a path, or None (no cache). An empty string is refused: it would
    make the current directory the node cache."""
    if cache_dir is None:
        return None
    path = os.fsdecode(cache_dir)
    if not path.strip():
        raise ConfigError("cache_dir: empty; pass a directory on local disk (NVMe) or None to stream without a cache")
    return path
