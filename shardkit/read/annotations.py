"""Side columns of a dataset (``shardkit annotate``): the read side.

An annotation is one Parquet file, ``manifest/annotations/<name>.parquet``, beside the samples
fragments: a column ``__index__`` (global sample indices, ascending, unique) and the table's
columns. It is joined on ``__index__`` at read time (``where=`` sees its columns, readers
asked for them return them as ``sample["__annotations__"]``). Its schema metadata
``shardkit.annotation`` records the shards it was written for (their count and the hash of
their checksums, as :attr:`~shardkit.read.dataset.Dataset.fingerprint`): a reader accepts it
when its own first shards are those (so an annotation stays valid for a dataset that grew by
appended shards, whose old samples keep their indices) and refuses it otherwise.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from shardkit.errors import ManifestError, first_line
from shardkit.read.dataset import Dataset
from shardkit.read.manifest_copies import copy_path, keep_copy

__all__ = ["ANNOTATIONS_DIR", "ANNOTATION_KEY", "Annotations", "annotation_files", "annotation_listing",
           "annotation_meta",
           "shards_fingerprint"]

ANNOTATIONS_DIR = "manifest/annotations"
ANNOTATION_KEY = b"shardkit.annotation"


def shards_fingerprint(ds: Dataset, num_shards: int) -> str:
    """The hash of the checksums of the first ``num_shards`` shards (all of them: the dataset's
    :attr:`~shardkit.read.dataset.Dataset.fingerprint`).

    Args:
        ds: the dataset.
        num_shards: how many shards, from the first.

    Returns:
        A hex digest.
    """
    checksums = ds.shards.column("checksum").to_pylist()[:num_shards]
    return xxhash.xxh3_64_hexdigest("\0".join(checksums).encode())


def annotation_meta(ds: Dataset, on: str) -> dict[bytes, bytes]:
    """The schema metadata an annotation of ``ds`` written now records.

    Args:
        ds: the dataset annotated.
        on: the column the table was joined on.

    Returns:
        ``{ANNOTATION_KEY: JSON}``.
    """
    record = {"on": on, "num_shards": ds.num_shards, "num_samples": ds.num_samples,
              "shards_fingerprint": shards_fingerprint(ds, ds.num_shards)}
    return {ANNOTATION_KEY: json.dumps(record, sort_keys=True).encode()}


def _check_meta(ds: Dataset, where: str, schema: pa.Schema) -> None:
    raw = (schema.metadata or {}).get(ANNOTATION_KEY)
    try:
        record: Any = json.loads(raw) if raw is not None else {}
        shards, fp = int(record["num_shards"]), str(record["shards_fingerprint"])
    except (ValueError, TypeError, KeyError):
        raise ManifestError(f"{where}: no readable {ANNOTATION_KEY.decode()} record; write it again with "
                            "shardkit annotate") from None
    if shards > ds.num_shards or shards_fingerprint(ds, shards) != fp:
        raise ManifestError(f"{where} was written for another pack of {ds.url} (its {shards} shards differ): "
                            "annotate the dataset again")


def annotation_listing(ds: Dataset) -> list[tuple[str, int]]:
    """The annotations stored beside ``ds``'s manifest now, with their sizes (what a stored
    ``where=`` result is keyed by, besides the query: an annotation added or replaced since
    makes a new one).

    Args:
        ds: the dataset.

    Returns:
        (path in the dataset, size in bytes) of each, by path.

    Raises:
        StorageError: listing failed.
    """
    return [(name, ds.store.size(name)) for name in ds.store.glob(f"{ANNOTATIONS_DIR}/*.parquet")]


def annotation_files(ds: Dataset, scratch: str) -> dict[str, str]:
    """Local files of ``ds``'s annotations (copied next to the manifest copies, or without
    them into ``scratch``), each checked to be written for this pack.

    Args:
        ds: the dataset.
        scratch: where copies go when ``ds`` has no ``manifest_cache`` (the caller removes it).

    Returns:
        Annotation name -> local path, by name.

    Raises:
        ManifestError: an annotation is unreadable or written for another pack.
        StorageError: listing or reading one failed.
    """
    listed = annotation_listing(ds)
    if not listed:
        return {}
    where = ds.manifest_cache or scratch
    out: dict[str, str] = {}
    for name, size in listed:
        path = copy_path(where, f"{name}.{size}")  # an annotation replaced since gets a new copy
        if not os.path.exists(path):
            keep_copy(where, f"{name}.{size}", ds.store.read_bytes(name))
            if not os.path.exists(path):
                raise ManifestError(f"could not keep a local copy of {ds.store.url_of(name)} in {where}")
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as exc:
            raise ManifestError(f"{ds.store.url_of(name)} is unreadable ({first_line(exc)})") from exc
        _check_meta(ds, ds.store.url_of(name), schema)
        out[os.path.basename(name)[:-len(".parquet")]] = path
    return out


class Annotations:
    """Every side column of a dataset, in memory, looked up by global sample index.

    Args:
        ds: the dataset.

    Raises:
        ManifestError: an annotation is unreadable or written for another pack.
        StorageError: listing or reading one failed.
    """

    def __init__(self, ds: Dataset) -> None:
        self.tables: list[tuple[np.ndarray, pa.Table]] = []
        with tempfile.TemporaryDirectory(prefix="shardkit-annotations-") as scratch:
            for path in annotation_files(ds, scratch).values():
                table = pq.read_table(path, use_threads=False)
                index = table.column("__index__").to_numpy()
                self.tables.append((index, table.drop_columns(["__index__"])))

    @property
    def columns(self) -> list[str]:
        """The side columns' names."""
        return [c for _, t in self.tables for c in t.column_names]

    def __bool__(self) -> bool:
        return bool(self.tables)

    def lookup(self, indices: np.ndarray) -> dict[str, list[Any]]:
        """The side columns of samples ``indices``.

        Args:
            indices: global sample indices.

        Returns:
            Column -> one value per index (None where the annotation has no row for it).
        """
        idx = np.asarray(indices, np.int64).reshape(-1)
        out: dict[str, list[Any]] = {}
        for index, table in self.tables:
            at = np.minimum(np.searchsorted(index, idx), max(len(index) - 1, 0))
            hit = (index[at] == idx) if len(index) else np.zeros(idx.size, bool)
            taken = table.take(pa.array(at)) if len(index) else None
            for name in table.column_names:
                values = taken.column(name).to_pylist() if taken is not None else [None] * idx.size
                out[name] = [v if h else None for v, h in zip(values, hit.tolist())]
        return out

    def row(self, index: int) -> dict[str, Any]:
        """The side columns of one sample.

        Args:
            index: its global sample index.

        Returns:
            Column -> value (None where an annotation has no row for it).
        """
        return {k: v[0] for k, v in self.lookup(np.array([index])).items()}
