"""Hugging Face ``datasets.Dataset`` and ``IterableDataset`` objects as pack sources.

A ``Dataset`` is indexable: :class:`HfSource` lists it by row number and each pack task reads
its rows as Arrow (``with_format("arrow")``, a block of rows at a time), so it runs on the Ray
engine too (the dataset is pickled into each task: one loaded from disk pickles as its cache
file paths, an in-memory one as all of its rows). An ``IterableDataset`` cannot be listed
ahead: it is packed through the iterable path (``engine="local"``, no resume), its rows read
as Arrow batches too.

Rows become samples by the rule of :mod:`~shardkit.packing.sources.table_rows`, with strings
as ``<column>.txt`` fields; in short: ``Image``/``Audio`` features -> their encoded bytes as
stored (``<column>.jpg``, ``.png``..., never decoded or re-encoded), binary -> the bytes, lists of
numbers and arrays -> ``<column>.npy``, strings -> ``<column>.txt``, a ``ClassLabel`` (or an
integer ``label``) -> ``cls`` (its names become dataset.json's ``labels``), other numbers and
booleans -> metadata. Keys come from a ``__key__`` or ``key`` column, else the row number.

``datasets`` is imported only when such an object is passed: it is recognised by its type's
module and name (:func:`hf_kind`), not by importing the package.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from shardkit.errors import SourceError
from shardkit.packing.sample import PackSample
from shardkit.packing.sources.base import SourceItem, item_bytes
from shardkit.packing.sources.optional import require
from shardkit.packing.sources.table_rows import RowPlan, parse_payload_columns, plan_columns

__all__ = ["HfSource", "hf_iterable_samples", "hf_kind"]

#: Rows a task reads from a Dataset at once (kept until it moves past them).
BLOCK_ROWS = 256


def hf_kind(obj: Any) -> str | None:
    """Whether ``obj`` is a Hugging Face dataset, without importing ``datasets``.

    Args:
        obj: anything.

    Returns:
        ``"Dataset"`` or ``"IterableDataset"``, or None for anything else.
    """
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "datasets" and cls.__name__ in ("Dataset", "IterableDataset"):
            return cls.__name__
    return None


def _schema(table: Any, features: Any) -> Any:
    """A block's Arrow schema, with the dataset's features (ClassLabel names...) as metadata."""
    schema = table.schema
    if not (schema.metadata or {}).get(b"huggingface") and features is not None:
        meta = getattr(getattr(features, "arrow_schema", None), "metadata", None)
        if meta:
            schema = schema.with_metadata(meta)
    return schema


class HfSource:
    """A Hugging Face ``datasets.Dataset``, one sample per row (see the module docstring).

    Args:
        dataset: the dataset.
        payload_columns: column -> field for binary columns (``{"img": "jpg"}``).

    Raises:
        SourceError: ``datasets`` is not installed (saying how to install it), or ``dataset``
            is no ``datasets.Dataset``.
    """

    def __init__(self, dataset: Any, payload_columns: str | Mapping[str, str] | None = None) -> None:
        require("hf")
        if hf_kind(dataset) != "Dataset":
            raise SourceError(f"HfSource: expected a datasets.Dataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self.payload_columns = parse_payload_columns(payload_columns)
        self._block: tuple[int, Any] | None = None
        self._plan: RowPlan | None = None

    def __repr__(self) -> str:
        return f"HfSource({len(self.dataset)} rows)"

    def __getstate__(self) -> dict[str, Any]:
        """The dataset and options; the block of rows read is not shipped to tasks."""
        return {"dataset": self.dataset, "payload_columns": self.payload_columns, "_block": None, "_plan": None}

    def _rows(self, start: int, stop: int) -> Any:
        return self.dataset.with_format("arrow")[start:stop]

    def plan(self) -> RowPlan:
        """How the dataset's columns are packed.

        Returns:
            The plan.

        Raises:
            SourceError: a column has no rule.
        """
        if self._plan is None:
            self._plan = plan_columns(_schema(self._rows(0, 0), self.dataset.features), self._where(),
                                      self.payload_columns, text_fields=True, key_columns=("__key__", "key"))
        return self._plan

    def _where(self) -> str:
        name = getattr(getattr(self.dataset, "info", None), "dataset_name", None)
        return f"Hugging Face dataset {name}" if name else "Hugging Face dataset"

    def list_items(self) -> list[SourceItem]:
        """One item per row; reads only the key column, if any.

        Returns:
            The items, in row order; ``ref`` is ``row <n>``.

        Raises:
            SourceError: a column has no rule, the dataset is empty, or two rows share a key.
        """
        plan = self.plan()
        n = len(self.dataset)
        data = self.dataset.data
        per_row = data.nbytes // max(1, data.num_rows)  # an estimate for the plan: the writer measures
        fields = [c.field + (".jpg" if c.role == "blob" else "") for c in plan.columns if c.role != "meta"]
        share = per_row // max(1, len(fields))
        keys = self.dataset.select_columns([plan.key_column]).with_format("arrow") if plan.key_column else None
        items, seen = [], set()
        for start in range(0, n, 65536):
            block = keys[start:start + 65536].column(0).to_pylist() if keys is not None else None
            for i in range(start, min(n, start + 65536)):
                key = plan.key({str(plan.key_column): block[i - start]} if block is not None else {}, i)
                if key in seen:
                    raise SourceError(f"{self._where()}: row {i}: key {key!r} is also another row's")
                seen.add(key)
                items.append(SourceItem(ref=f"row {i}", nbytes=item_bytes(key, ((f, share) for f in fields)), key=key))
        return items

    def load(self, item: SourceItem) -> PackSample:
        """Read one row (its block of :data:`BLOCK_ROWS` rows once, as Arrow).

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample; metadata ``source`` is ``row <n>``.

        Raises:
            SourceError: the row has no payload, or a blob's file cannot be read.
        """
        index = int(item.ref.rpartition(" ")[2])
        block = index // BLOCK_ROWS
        if self._block is None or self._block[0] != block:
            self._block = None
            self._block = (block, self._rows(block * BLOCK_ROWS, (block + 1) * BLOCK_ROWS))
        row = self._block[1].slice(index - block * BLOCK_ROWS, 1).to_pylist()[0]
        fields, meta = self.plan().fields_of(row, f"{self._where()}: {item.ref}")
        meta["source"] = item.ref
        return PackSample(item.key, fields, meta)

    def task_done(self) -> None:
        """Let the block of rows a task read go."""
        self._block = None

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json (and a rerun's resume check).

        Returns:
            ``{"type": "hf", "rows": n, "fingerprint": ...}``: the dataset's fingerprint
            changes with its content and every transform applied to it.
        """
        out: dict[str, Any] = {"type": "hf", "rows": len(self.dataset),
                               "fingerprint": getattr(self.dataset, "_fingerprint", None)}
        name = getattr(getattr(self.dataset, "info", None), "dataset_name", None)
        if name:
            out["name"] = name
        return out

    def labels(self) -> dict[str, int] | None:
        """The names of the ``ClassLabel`` column packed as ``cls``.

        Returns:
            Class name -> index, or None.
        """
        classes = self.plan().classes
        return {name: i for i, name in enumerate(classes)} if classes else None


def hf_iterable_samples(dataset: Any, payload_columns: str | Mapping[str, str] | None = None,
                        batch_rows: int = BLOCK_ROWS) -> Iterator[dict[str, Any]]:
    """The rows of an ``IterableDataset`` as sample dicts for the iterable path.

    Args:
        dataset: the ``datasets.IterableDataset``.
        payload_columns: column -> field for binary columns.
        batch_rows: rows read at once.

    Yields:
        ``{"__key__": ..., <field>: bytes, ..., "__meta__": {...}}`` per row, in order.

    Raises:
        SourceError: ``datasets`` is missing, a column has no rule, or a row has no payload.
    """
    require("hf")
    payload = parse_payload_columns(payload_columns)
    plan: RowPlan | None = None
    index = 0
    for table in dataset.with_format("arrow").iter(batch_size=batch_rows):
        if plan is None:
            plan = plan_columns(_schema(table, getattr(dataset, "features", None)), "Hugging Face IterableDataset",
                                payload, text_fields=True, key_columns=("__key__", "key"))
        for row in table.to_pylist():
            fields, meta = plan.fields_of(row, f"Hugging Face IterableDataset: row {index}")
            yield {"__key__": plan.key(row, index), **fields, "__meta__": meta}
            index += 1
