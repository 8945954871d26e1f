"""shardkit for Ray Data: ``ds.write_datasink(shardkit.ray.Datasink("s3://bucket/ds"))``.

This module imports without Ray; Ray is imported when :class:`Datasink` is first used, and
its absence is then a :class:`~shardkit.errors.ConfigError` saying how to install it. The
datasink itself is :class:`shardkit.packing.ray_datasink.Datasink`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shardkit.errors import ConfigError

if TYPE_CHECKING:  # imported on first use (below): it imports Ray
    from shardkit.packing.ray_datasink import Datasink

__all__ = ["Datasink", "INSTALL_HINT"]

INSTALL_HINT = "shardkit.ray.Datasink needs Ray Data: pip install 'shardkit[ray]'"


def __getattr__(name: str) -> Any:
    if name != "Datasink":
        raise AttributeError(f"module 'shardkit.ray' has no attribute {name!r}")
    try:
        importlib.import_module("ray.data")
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    return importlib.import_module("shardkit.packing.ray_datasink").Datasink
