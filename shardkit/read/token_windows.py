"""Fixed-length token windows over a dataset of tokenized documents: which windows exist, how
many start in each shard, and which document tokens make up window ``w``.

A pure function of the per-document token counts (the manifest's ``num_tokens`` column, written
by :class:`~shardkit.packing.sources.tokens.TokenSource`), the documents per shard and the
options, so every rank and DataLoader worker computes the same windows without coordination.

Each document is followed by ``eos_token`` when one is given (in both modes). A window is
``span = block_size + 1`` tokens with ``targets`` (inputs ``w[:-1]``, next-token targets
``w[1:]``), else ``block_size``; window ``w + 1`` starts ``block_size`` tokens after window ``w``,
so with ``targets`` consecutive windows share one token and every token is a target once.

* ``respect_documents=False``: the documents (each with its EOS) are concatenated into one
  token stream; window ``w`` is stream tokens ``[w * block_size, w * block_size + span)``; the
  last partial window is dropped (fewer than ``span`` tokens).
* ``respect_documents=True``: windows never cross a document boundary: document ``d`` of
  ``L_d`` tokens (its EOS included) gives ``(L_d - span) // block_size + 1`` windows (none if
  ``L_d < span``); each document's short tail is dropped, not padded.

Windows are numbered in stream order, so the windows that *start* in shard ``k`` are one
contiguous range: :attr:`TokenWindows.shard_windows` plays the part of a dataset's samples per
shard for the epoch order and partition (:mod:`shardkit.read.epoch_order`,
:mod:`shardkit.read.partition`), and a reader of a window needs its shard (and, for a window
that runs past the shard's last document, the next ones).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

from shardkit.config import int_arg
from shardkit.errors import ConfigError, ShardkitError
from shardkit.read.dataset import Dataset

__all__ = ["TOKEN_COLUMN", "Piece", "TokenWindows", "token_counts"]

TOKEN_COLUMN = "num_tokens"
IntArray = NDArray[np.int64]


class Piece(NamedTuple):
    """A part of a window: tokens ``start:stop`` of document ``doc``, then its EOS if ``eos``.

    Attributes:
        doc: the document's global sample index.
        start: its first token in the window.
        stop: one past its last token in the window.
        eos: whether the document's EOS token follows.
    """

    doc: int
    start: int
    stop: int
    eos: bool


def token_counts(ds: Dataset) -> IntArray:
    """Each document's token count, from the manifest's ``num_tokens`` column (one row group
    per shard, that column only).

    Args:
        ds: a dataset packed from tokenized documents.

    Returns:
        int64 counts, one per sample in global order.

    Raises:
        ConfigError: the dataset has no ``num_tokens`` column (not packed as tokens), or holds
            a negative or missing count.
    """
    parts: list[IntArray] = []
    for shard in range(ds.num_shards):
        try:
            table = ds.shard_samples(shard, columns=[TOKEN_COLUMN])
        except (ShardkitError, KeyError) as exc:
            if ds.shard_list[shard].num_samples and TOKEN_COLUMN in str(exc):
                raise ConfigError(_not_tokens(ds)) from None
            raise
        if TOKEN_COLUMN not in table.column_names:
            raise ConfigError(_not_tokens(ds))
        col = table.column(TOKEN_COLUMN)
        if col.null_count:
            raise ConfigError(f"{ds.url}: shard {shard} has samples without {TOKEN_COLUMN}; not a token dataset")
        parts.append(col.to_numpy().astype(np.int64))
    counts = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if counts.size and counts.min() < 0:
        raise ConfigError(f"{ds.url}: a negative {TOKEN_COLUMN} in the manifest (a damaged manifest)")
    return counts


def _not_tokens(ds: Dataset) -> str:
    return (f"{ds.url} is not a token dataset (its manifest has no {TOKEN_COLUMN} column): pack tokenized "
            "documents with shardkit pack SRC DEST --token-dtype uint16|uint32 (or --token-column for Parquet)")


class TokenWindows:
    """The windows of one token dataset (see the module docstring).

    Args:
        doc_tokens: tokens per document, in global sample order.
        docs_per_shard: documents (samples) per shard.
        block_size: tokens per window (without the extra target token).
        respect_documents: never cross a document boundary.
        eos_token: a token id put after every document, or None.
        targets: windows of ``block_size + 1`` tokens (next-token targets).

    Raises:
        ConfigError: a bad option, or shard sizes that do not sum to the documents.
    """

    def __init__(self, doc_tokens: ArrayLike, docs_per_shard: ArrayLike, block_size: int, *,
                 respect_documents: bool = False, eos_token: int | None = None, targets: bool = True) -> None:
        self.block_size = int_arg("block_size", block_size, 1)
        self.eos_token = None if eos_token is None else int_arg("eos_token", eos_token, 0, 2**32 - 1)
        self.respect_documents, self.targets = bool(respect_documents), bool(targets)
        self.span = self.block_size + (1 if self.targets else 0)
        self.doc_tokens = np.asarray(doc_tokens, dtype=np.int64)
        per_shard = np.asarray(docs_per_shard, dtype=np.int64)
        if int(per_shard.sum()) != self.doc_tokens.size:
            raise ConfigError(f"TokenWindows: shards hold {int(per_shard.sum())} documents, "
                              f"{self.doc_tokens.size} token counts given")
        first_doc = np.concatenate(([0], np.cumsum(per_shard))).astype(np.int64)
        lengths = self.doc_tokens + (0 if self.eos_token is None else 1)
        self.starts = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)  # stream offset per document
        b = self.block_size
        if self.respect_documents:
            per_doc = np.where(lengths >= self.span, (lengths - self.span) // b + 1, 0)
            self.first_window = np.concatenate(([0], np.cumsum(per_doc))).astype(np.int64)
            self.num_windows = int(self.first_window[-1])
            bounds = self.first_window[first_doc]
        else:
            total = int(self.starts[-1])
            self.num_windows = (total - self.span) // b + 1 if total >= self.span else 0
            # Windows starting in shard k: those whose first token lies in its documents.
            bounds = np.minimum(-(-self.starts[first_doc] // b), self.num_windows)
        self.shard_windows: IntArray = np.diff(bounds).astype(np.int64)

    def geometry(self) -> dict[str, Any]:
        """The options that make the windows, as a resume state records them.

        Returns:
            A JSON-able dict.
        """
        return {"block_size": self.block_size, "respect_documents": self.respect_documents,
                "eos_token": self.eos_token, "targets": self.targets, "num_windows": self.num_windows}

    @property
    def total_tokens(self) -> int:
        """Tokens in the documents (EOS tokens not counted)."""
        return int(self.doc_tokens.sum())

    def pieces(self, w: int) -> list[Piece]:
        """The document tokens window ``w`` is made of, in order.

        Args:
            w: a window index in ``[0, num_windows)``.

        Returns:
            Its pieces; their tokens (and EOS tokens) add up to ``span``.

        Raises:
            IndexError: ``w`` is out of range.
        """
        if not 0 <= w < self.num_windows:
            raise IndexError(f"window {w} out of range 0..{self.num_windows - 1}")
        if self.respect_documents:
            d = int(np.searchsorted(self.first_window, w, side="right")) - 1
            a = (w - int(self.first_window[d])) * self.block_size
            return [self._piece(d, a, a + self.span)]
        t0, t1 = w * self.block_size, w * self.block_size + self.span
        d = int(np.searchsorted(self.starts, t0, side="right")) - 1
        out = []
        while t0 < t1:
            s, e = int(self.starts[d]), int(self.starts[d + 1])
            if e > t0:
                out.append(self._piece(d, t0 - s, min(t1, e) - s))
                t0 = min(t1, e)
            d += 1
        return out

    def _piece(self, d: int, a: int, b: int) -> Piece:
        """Tokens ``a:b`` of document ``d`` with its EOS (index ``num_tokens``) counted."""
        n = int(self.doc_tokens[d])
        return Piece(d, min(a, n), min(b, n), self.eos_token is not None and b > n)
