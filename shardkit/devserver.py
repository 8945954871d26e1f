"""Compatibility path: ``python -m shardkit.devserver`` runs :mod:`shardkit.dev.devserver`."""

from shardkit.dev.devserver import *  # noqa: F401,F403
from shardkit.dev.devserver import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
