"""Sources that need an optional package, and how to install it when it is missing.

The package is imported when the source first needs it, not when shardkit is imported: a pack
of images never needs h5py.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from shardkit.errors import SourceError

__all__ = ["OPTIONAL_SOURCES", "Requirement", "require"]


@dataclass(frozen=True)
class Requirement:
    """What a source needs beyond shardkit's own dependencies.

    Attributes:
        source: the source class, as the error names it.
        module: the package it imports.
        extra: the shardkit extra that installs it.
    """

    source: str
    module: str
    extra: str

    @property
    def hint(self) -> str:
        """The one-line error saying how to install it."""
        return f"{self.source} needs {self.module}: pip install 'shardkit[{self.extra}]'"


OPTIONAL_SOURCES: dict[str, Requirement] = {
    "hdf5": Requirement("Hdf5Source", "h5py", "hdf5"),
    "zarr": Requirement("ZarrSource", "zarr", "zarr"),
    "lmdb": Requirement("LmdbSource", "lmdb", "lmdb"),
    "hf": Requirement("HfSource", "datasets", "hf"),
}


def require(kind: str) -> ModuleType:
    """The package the ``kind`` of source needs, imported.

    Args:
        kind: a key of :data:`OPTIONAL_SOURCES` (``"hdf5"``).

    Returns:
        The imported package.

    Raises:
        SourceError: it is not installed (the error says how to install it).
    """
    needed = OPTIONAL_SOURCES[kind]
    try:
        return importlib.import_module(needed.module)
    except ImportError as exc:
        raise SourceError(needed.hint) from exc
