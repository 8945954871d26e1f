"""Compatibility path: ``python -m shardkit.demo`` runs :mod:`shardkit.dev.demo`."""

from shardkit.dev.demo import *  # noqa: F401,F403
from shardkit.dev.demo import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
