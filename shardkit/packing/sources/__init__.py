"""Pack sources: how the planner sees any input, and the adapters from inputs to it.

:func:`resolve_source` picks a source for a path, glob or URL; the source classes can also be
made and passed to :func:`shardkit.pack` directly.
"""

from __future__ import annotations

from shardkit.packing.sources.base import Source, SourceItem
from shardkit.packing.sources.filelist import FileListSource
from shardkit.packing.sources.files import FolderSource
from shardkit.packing.sources.imagefolder import ImageFolderSource
from shardkit.packing.sources.hdf5 import Hdf5Source
from shardkit.packing.sources.lmdb import LmdbSource
from shardkit.packing.sources.npy import NpySource
from shardkit.packing.sources.resolve import resolve_source
from shardkit.packing.sources.hf import HfSource
from shardkit.packing.sources.table import TableSource
from shardkit.packing.sources.tfrecord import TfRecordSource
from shardkit.packing.sources.tokens import TokenSource
from shardkit.packing.sources.wds import WdsTarSource
from shardkit.packing.sources.zarr import ZarrSource

__all__ = ["Source", "SourceItem", "FolderSource", "ImageFolderSource", "FileListSource", "Hdf5Source", "NpySource",
           "WdsTarSource", "resolve_source", "ZarrSource", "LmdbSource"]
__all__ += ["TfRecordSource", "TableSource", "HfSource", "TokenSource"]
