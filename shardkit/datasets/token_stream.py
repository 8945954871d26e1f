"""``TokenStream``: fixed-length token windows of tokenized documents, for LLM pre-training.

``TokenStream(url, block_size=2048)`` yields windows of ``block_size + 1`` tokens (int64 torch
tensors; ``x, y = w[:-1], w[1:]``) of a dataset packed from tokenized documents
(:class:`~shardkit.packing.sources.tokens.TokenSource`). What a window is, with and without
``respect_documents``, is in :mod:`shardkit.read.token_windows`.

Windows are the unit of everything else, exactly as samples are for
:class:`~shardkit.StreamingDataset`: the windows starting in each shard stand for the shard's
samples, and a :class:`~shardkit.datasets.mixed.MixedStreamingDataset` over those counts gives
the epoch order (shuffled by blocks of shards with ``shuffle``), the exact split over ranks and
DataLoader workers (equal counts, no overlap), ``state_dict``/``load_state_dict`` with any world
size or worker count, and weighted mixing: ``TokenStream([Stream(a, weight=0.7), Stream(b,
weight=0.3)])`` mixes windows of several token datasets (weights, ``repeat``, ``choose`` and
``epoch_size`` count windows). The window options are part of the resume state: a state saved
with another ``block_size`` (or mode, EOS, targets) is refused in one line.

A reader fetches the documents of its own windows only, through
:class:`~shardkit.ShardDataset`: with ``cache_dir``, each shard it needs is downloaded once per
node into the shared node cache (the one StreamingDataset uses), without, only the token rows
of each window are read with ranged GETs.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Iterator, Sequence, cast

import numpy as np

from shardkit.config import int_arg
from shardkit.datasets.mixed import MixedStreamingDataset, as_streams
from shardkit.datasets.random_access import ShardDataset
from shardkit.datasets.token_reads import read_documents
from shardkit.datasets.tensors import in_main_process
from shardkit.errors import ConfigError, ManifestError
from shardkit.read.epoch_order import DEFAULT_BLOCK_SHARDS
from shardkit.read.mixture import mixture_counts, positions_of
from shardkit.read.shard_source import ShardSource
from shardkit.read.stream import Stream
from shardkit.read.token_windows import TokenWindows, token_counts

__all__ = ["TOKEN_FIELD", "TokenStream"]

TOKEN_FIELD = "tokens.npy"  # the member TokenSource writes (shardkit.packing.sources.tokens)
_WHOLE_DOC = 1 << 20  # documents up to this many tokens are read whole and kept for the next windows
_KEPT_DOCS = 8
_PIECE = 256  # windows whose documents are read together without a cache (bounds the memory it takes)
_RUN_DOC = 1 << 14  # without a cache, documents up to this many tokens are read in runs of neighbours


class TokenStream(MixedStreamingDataset):
    """Fixed-length token windows of one or more token datasets, exact per rank and resumable.

    Args:
        url: a token dataset's root, or a list of :class:`shardkit.Stream` to mix several by
            weight (counted in windows).
        block_size: tokens per window (plus one next-token target with ``targets``).
        respect_documents: windows never cross a document boundary (each document's short
            tail is dropped); otherwise the documents are one concatenated token stream.
        eos_token: a token id put after every document (default: none).
        targets: yield ``block_size + 1`` tokens per window, consecutive windows overlapping
            by one token, so ``w[:-1]`` are the inputs and ``w[1:]`` the targets; ``False``:
            ``block_size`` tokens, windows back to back.
        cache_dir: node cache shared by every rank, worker and stream of the node (None: read
            token rows with ranged GETs).
        cache_limit: the cache's bound (``"200GB"``).
        shuffle: shuffle windows within blocks of ``shuffle_block`` shards, per epoch, from ``seed``.
        seed: the shuffle and mixture seed.
        drop_last: drop the tail so every rank gets floor(N/W) windows; otherwise ranks are
            padded to ceil(N/W) by repeating windows from the start of the epoch.
        storage_options: fsspec/s3fs options (the default of streams that give none).
        shuffle_block: shards per shuffle block.
        loader_batch_size: the DataLoader's batch size (``StreamingDataLoader`` sets it): workers
            take turns in whole batches, so resume is exact.
        epoch_size: windows per epoch of a weighted mixture (default: all windows).
        rank: this process's rank (default: torch.distributed's, else ``RANK``, else 0).
        world_size: ranks sharing the epoch (default: torch.distributed's, else ``WORLD_SIZE``).

    Raises:
        ConfigError: a bad option, or a dataset that was not packed as tokens.
        DatasetNotFoundError: nothing is at a URL.
        StorageError: a dataset's metadata could not be read.
    """

    def __init__(self, url: Any, block_size: int = 2048, *, respect_documents: bool = False,
                 eos_token: int | None = None, targets: bool = True,
                 cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str = "200GB",
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 storage_options: dict[str, Any] | None = None, shuffle_block: int = DEFAULT_BLOCK_SHARDS,
                 loader_batch_size: int | None = None, epoch_size: int | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        streams = as_streams(url) or [Stream(url)]
        block_size = int_arg("block_size", block_size, 1)
        super().__init__(streams, cache_dir=cache_dir, cache_limit=cache_limit, shuffle=shuffle, seed=seed,
                         drop_last=drop_last, storage_options=storage_options, shuffle_block=shuffle_block,
                         loader_batch_size=loader_batch_size, rank=rank, world_size=world_size)
        self._storage = [s.storage_options or storage_options for s in streams]
        self.windows = [TokenWindows(token_counts(ds), ds.shard_sizes(), block_size,
                                     respect_documents=respect_documents, eos_token=eos_token, targets=targets)
                        for ds in self.dss]
        self.block_size, self.respect_documents = block_size, bool(respect_documents)
        self.eos_token, self.targets = eos_token, bool(targets)
        # The mixture machinery sees windows: per stream, the windows starting in each shard.
        self._shard_sizes = [w.shard_windows for w in self.windows]
        self.epoch_size = epoch_size
        self._full = tuple(mixture_counts([w.num_windows for w in self.windows], self._shares, epoch_size))
        self._counts, self._history = self._full, ()
        self._readers: dict[int, ShardDataset] | None = None
        self._write_control()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_readers"] = None  # each process opens its own
        return state

    @property
    def num_windows(self) -> list[int]:
        """Windows of each stream (one epoch of each, before weights)."""
        return [w.num_windows for w in self.windows]

    def _geometry(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "respect_documents": self.respect_documents,
                "eos_token": self.eos_token, "targets": self.targets,
                "num_windows": [w.num_windows for w in self.windows]}

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The resumable position (windows consumed), with the window options.

        Args:
            consumed: windows this rank has consumed this epoch (default: those this object
                yielded in this process; with DataLoader workers use StreamingDataLoader).

        Returns:
            A JSON-able dict for :meth:`load_state_dict`.
        """
        state = super().state_dict(consumed)
        state["tokens"] = self._geometry()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a stopped epoch with any world size, worker count or weights.

        Args:
            state: a dict :meth:`state_dict` of a TokenStream over the same datasets returned.

        Raises:
            ConfigError: the state is malformed, not a TokenStream's, made with other window
                options, or on other data (see MixedStreamingDataset.load_state_dict).
        """
        saved = state.get("tokens") if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            raise ConfigError("state_dict: not saved by a TokenStream (no window options); resume a TokenStream "
                              "from TokenStream.state_dict")
        mine = self._geometry()
        for name, value in mine.items():
            if saved.get(name) != value:
                raise ConfigError(f"state_dict: saved with {name}={saved.get(name)!r}, this TokenStream has "
                                  f"{value!r}; resume with the window options it was saved with")
        super().load_state_dict(state)

    # ---- reading --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """This reader's windows of the epoch, in order.

        Yields:
            1-D int64 tensors of ``block_size + 1`` tokens (``block_size`` without ``targets``).

        Raises:
            ManifestError: a document's tokens disagree with its manifest count.
            IntegrityError: a sample fails its checksum.
            StorageError: reading from storage failed.
        """
        import torch

        topo, order, ranges = self._epoch_ranges()
        in_main = topo.num_workers == 1 and in_main_process()
        if in_main:
            self._yielded = 0
        kept: list[OrderedDict[int, np.ndarray]] = [OrderedDict() for _ in self.dss]
        ahead: list[dict[int, np.ndarray]] = [{} for _ in self.dss]
        fetched = _Fetched([self._reader(i) for i in range(len(self.dss))])
        self._stats.begin()
        nbytes = 8 * max((w.span for w in self.windows), default=0)
        try:
            for pos in positions_of(ranges, piece=_PIECE):
                streams, windows = order.take(pos)
                if self.cache_dir is None:  # the piece's short documents, in few ranged reads
                    ahead = self._read_ahead(streams.tolist(), windows.tolist())
                for s, w in zip(streams.tolist(), windows.tolist()):
                    out = torch.from_numpy(self._window(s, w, kept[s], ahead[s]))
                    if in_main:
                        self._yielded += 1
                    if self._stats.count(1, nbytes):
                        self._stats.save(cast(ShardSource, fetched), topo, final=False)
                    yield out
        finally:
            self._stats.save(cast(ShardSource, fetched), topo, final=True)
            for reader in fetched.readers:  # unpin the cached shards held open (they reopen next epoch)
                reader.close()

    def _read_ahead(self, streams: list[int], windows: list[int]) -> list[dict[int, np.ndarray]]:
        """Per stream, the documents of these windows of at most :data:`_RUN_DOC` tokens (larger
        ones are read as the windows need them), read by :func:`read_documents`."""
        need: list[set[int]] = [set() for _ in self.dss]
        for s, w in zip(streams, windows):
            geo = self.windows[s]
            need[s].update(p.doc for p in geo.pieces(w) if p.stop > p.start and geo.doc_tokens[p.doc] <= _RUN_DOC)
        return [read_documents(self._reader(s), docs, TOKEN_FIELD) if docs else {} for s, docs in enumerate(need)]

    def _reader(self, stream: int) -> ShardDataset:
        if self._readers is None:
            self._readers = {}
        reader = self._readers.get(stream)
        if reader is None:
            reader = ShardDataset(self.dss[stream].url, cache_dir=self.cache_dir, cache_limit=self.cache_limit,
                                  storage_options=self._storage[stream], cache_shards=self.cache_dir is not None)
            self._readers[stream] = reader
        return reader

    def _window(self, stream: int, w: int, kept: OrderedDict[int, np.ndarray],
                ahead: dict[int, np.ndarray]) -> np.ndarray:
        """Window ``w`` of stream ``stream`` as int64 tokens."""
        geo = self.windows[stream]
        out = np.empty(geo.span, dtype=np.int64)
        at = 0
        for p in geo.pieces(w):
            n = p.stop - p.start
            if n:
                out[at:at + n] = self._tokens(stream, p.doc, p.start, p.stop, kept, ahead)
                at += n
            if p.eos:
                out[at] = int(geo.eos_token or 0)  # eos is set only when eos_token is
                at += 1
        return out

    def _tokens(self, stream: int, doc: int, a: int, b: int, kept: OrderedDict[int, np.ndarray],
                ahead: dict[int, np.ndarray]) -> np.ndarray:
        """Tokens ``a:b`` of document ``doc``: read ahead with the piece's others, or small
        documents read whole and kept for the next windows (a window of a concatenated stream
        often starts where the last one ended)."""
        n = int(self.windows[stream].doc_tokens[doc])
        reader = self._reader(stream)
        arr = ahead.get(doc)
        if arr is None:
            arr = kept.get(doc)
        if arr is not None and arr.shape != (n,):
            raise ManifestError(self._mismatch(stream, doc, n))
        if arr is None and n > _WHOLE_DOC:
            try:
                part = reader.read_array(doc, TOKEN_FIELD, rows=slice(a, b))
            except IndexError:
                part = np.zeros(0)
            if part.shape != (b - a,):
                raise ManifestError(self._mismatch(stream, doc, n))
            return part
        if arr is None:
            arr = np.array(reader.read_array(doc, TOKEN_FIELD))  # a copy: no map of the cache held
            if arr.shape != (n,):
                raise ManifestError(self._mismatch(stream, doc, n))
        kept[doc] = arr
        kept.move_to_end(doc)
        while len(kept) > _KEPT_DOCS:
            kept.popitem(last=False)
        return arr[a:b]

    def _mismatch(self, stream: int, doc: int, n: int) -> str:
        return (f"{self.dss[stream].url}: sample {doc}'s {TOKEN_FIELD} does not hold the {n} tokens its manifest "
                "num_tokens says (a damaged manifest or shard)")


class _Fetched:
    """The readers' storage counters since the epoch began, as a shard source's stats (so
    :meth:`TokenStream.stats` counts ``bytes_fetched`` beside ``samples``, the windows)."""

    def __init__(self, readers: Sequence[ShardDataset]) -> None:
        self.readers = list(readers)
        self.start = [r.stats()["bytes_fetched"] for r in self.readers]

    def stats(self) -> dict[str, float]:
        return {"bytes_fetched": float(sum(r.stats()["bytes_fetched"] - a for r, a in zip(self.readers, self.start)))}
