"""``wds_shards``: shardkit's node cache and epoch order as the first stage of a WebDataset pipeline.

::

    pipeline = wds.DataPipeline(
        shardkit.wds_shards("s3://bucket/ds", cache_dir="/nvme/shardkit", shuffle=True, seed=0),
        wds.tarfile_to_samples(), wds.shuffle(1000), wds.decode("pil"), wds.batched(64))

The stage yields ``{"url": <local path of the cached, verified shard>}`` for the shards of
this rank / DataLoader worker / epoch, in :class:`~shardkit.read.partition.EpochOrder` shard order,
prefetching the next ones into the cache. Each shard stays pinned (never evicted) until the
pipeline asks for the next one, i.e. while downstream stages read it.

A shard not cached yet is not waited for: it comes as a ``shardkit-landing://`` URL that the
stage registers in WebDataset's ``gopen_schemes``, a stream of the shard's bytes as they land
(:class:`~shardkit.cache.landing_stream.LandingStream`: a byte once the sample holding it
matched its checksum, the archive's end once the whole shard did). The first samples flow while
the rest of the shard downloads, and the file is cached for other readers once it is whole.

A shard that finds no room in the cache for ``SHARDKIT_ROOM_WAIT`` seconds (default 5)
because other readers keep theirs open (DataLoader workers take turns, so a worker waiting for
room may be the one its sibling waits for) is read from storage into memory instead, checked
against the manifest, and yielded as a ``shardkit-mem://`` URL that the stage registers in
WebDataset's ``gopen_schemes``: the pipeline goes on, and a warning says to raise cache_limit.

The split is by whole shards: the epoch's shard order is dealt round-robin over
``world_size x num_workers`` readers, so readers' shard counts differ by one where the
shards do not divide evenly (nothing is repeated to pad them), and sample counts per rank
differ more. DDP training that needs exactly equal per-rank sample (or batch) counts and
exact resume should use :class:`shardkit.StreamingDataset` instead (or give the pipeline a
fixed length with ``.with_epoch(n)``).
"""

from __future__ import annotations

import functools
import importlib
import io
import itertools
import os
from typing import Any, Callable, Iterator

from shardkit.cache.landing_stream import LandingStream
from shardkit.cache.shard_cache import LandingShard, ShardCache
from shardkit.config import int_arg, parse_size, room_wait
from shardkit.datasets.epoch_control import ControlDir
from shardkit.errors import ConfigError, NoRoomError
from shardkit.read.epoch_order import DEFAULT_BLOCK_SHARDS, EpochOrder
from shardkit.read.dataset import Dataset
from shardkit.storage import ranged
from shardkit.read.cache_refs import cache_namespace, shard_ref
from shardkit.read.shard_source import JOIN_BELOW, ShardSource
from shardkit.read.topology import FromParent, current

__all__ = ["LANDING_SCHEME", "MEM_SCHEME", "wds_shards"]

try:  # torch is optional: without it the stage is a plain iterable
    from torch.utils.data import IterableDataset as _IterableBase
except ImportError:  # pragma: no cover - exercised only without torch
    _IterableBase = object  # type: ignore[misc,assignment]


class wds_shards(_IterableBase):  # type: ignore[misc,valid-type]  # noqa: N801 - a wds-style stage name
    """A WebDataset source stage yielding cached local shard paths for this reader.

    Args:
        url: shardkit dataset root.
        cache_dir: node-local cache directory (required: WebDataset reads local files).
        cache_limit: bound on the cache size.
        shuffle: shuffle the shard order each epoch (reproducibly from ``seed``).
        seed: shuffle seed.
        epoch: epoch number; or call :meth:`set_epoch` (read when iteration starts).
        storage_options: fsspec options for the dataset URL.
        prefetch: shards downloaded ahead of the one being read.
        rank: this process's rank (default: torch.distributed's, else the ``RANK`` variable,
            else 0; see :mod:`shardkit.read.topology`).
        world_size: ranks sharing the epoch (default: torch.distributed's, else ``WORLD_SIZE``,
            else 1).

    Raises:
        ConfigError: no ``cache_dir``, a mixture of Streams for ``url``, or a number out of range.
        DatasetNotFoundError: nothing is at ``url``.
    """

    def __init__(self, url: str, cache_dir: str | os.PathLike[str], cache_limit: int | str = "200GB", *,
                 shuffle: bool = False, seed: int = 0, epoch: int = 0, storage_options: dict[str, Any] | None = None,
                 prefetch: int = 2, rank: int | None = None, world_size: int | None = None) -> None:
        if cache_dir is None:
            raise ConfigError("wds_shards: cache_dir is required (WebDataset opens local files)")
        if not isinstance(url, (str, os.PathLike)):
            raise ConfigError("wds_shards: takes one dataset URL, not a mixture of Streams; mix datasets with "
                              "shardkit.StreamingDataset([shardkit.Stream(...), ...])")
        self.ds = Dataset(url, storage_options)
        ranged.prepare(self.ds.store)  # here, before DataLoader workers fork: their first reads come sooner
        self.cache_dir, self.cache_limit = os.fspath(cache_dir), parse_size(cache_limit, "cache_limit")
        self.shuffle, self.seed = bool(shuffle), int_arg("seed", seed, 0, 2**64 - 1)
        self.epoch, self.prefetch = int_arg("epoch", epoch, 0, 2**32 - 1), int_arg("prefetch", prefetch, 0)
        self.world_size = None if world_size is None else int_arg("world_size", world_size, 1)
        self.rank = None if rank is None else int_arg("rank", rank, 0)
        self._parent = FromParent()  # the rank, for DataLoader workers that are not forked
        # Persistent DataLoader workers keep the stage they started with: set_epoch reaches
        # them through this file, read when each iteration starts (as StreamingDataset does).
        self._control = ControlDir("shardkit-wds-")
        self._control.write({"epoch": self.epoch})

    def set_epoch(self, epoch: int) -> None:
        """Read the shards of ``epoch`` from the next iteration on (also in persistent workers).

        Args:
            epoch: the epoch number (0 to 2**32 - 1); it seeds the epoch's shuffle.

        Raises:
            ConfigError: ``epoch`` is not an int in range.
        """
        self.epoch = int_arg("epoch", epoch, 0, 2**32 - 1)
        self._control.write({"epoch": self.epoch})

    def shards(self) -> list[int]:
        """Shard ids this rank/worker reads this epoch, in order.

        Returns:
            Every ``world_size x num_workers``-th shard of the epoch's order, from this
            reader's place on (empty shards left out).
        """
        topo = current(self.rank, self.world_size, self._parent)
        epoch = int((self._control.read() or {}).get("epoch", self.epoch))
        order = EpochOrder(self.ds.shard_sizes(), epoch=epoch, seed=self.seed, shuffle=self.shuffle,
                           block_shards=DEFAULT_BLOCK_SHARDS)
        readers = topo.world_size * topo.num_workers
        me = topo.rank * topo.num_workers + topo.worker
        return [int(s) for s in order.shard_order[me::readers] if self.ds.shard_list[int(s)].num_samples]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This reader's shards, each cached, verified and pinned until the next is asked for.

        Yields:
            ``{"url": <local path>, "__shard__": <shard path in the dataset>}``; a shard still
            landing comes as a ``shardkit-landing://`` URL, one read around a full cache as a
            ``shardkit-mem://`` URL (see the module docstring).

        Raises:
            IntegrityError: a shard fails its checksum even after a fresh fetch.
            ManifestError: a shard's manifest rows place a sample or field outside its bytes.
            StorageError: reading from storage failed.
        """
        mine = self.shards()
        cache = ShardCache(self.cache_dir, self.cache_limit, namespace=cache_namespace(self.ds),
                           room_wait=room_wait())
        source = ShardSource(self.ds, cache, self.prefetch)
        source.stream = True
        infos = self.ds.shard_list
        try:
            source.plan(mine)
            for i, shard in enumerate(mine):
                source.advance(mine[i + 1:i + 1 + self.prefetch])
                # WebDataset parses the tar itself, but a manifest that places a field outside
                # its sample is refused here too, as every other reader refuses it.
                ref = shard_ref(infos[shard], source.rows(shard))
                try:
                    # Past the first shard, follow only a download with most of the way to go.
                    cached = cache.open(ref, source.fetch, stream=True, join_below=1.0 if i == 0 else JOIN_BELOW)
                except NoRoomError as exc:
                    url = _hold_in_memory(source.read_uncached(shard, exc), infos[shard].path)
                    try:
                        yield {"url": url, "__shard__": infos[shard].path}
                    finally:
                        _IN_MEMORY.pop(url, None)  # opened by now, or never will be
                    continue
                if isinstance(cached, LandingShard):
                    opened = functools.partial(cache.open, ref, source.fetch, stream=True)
                    url = _hold_stream(LandingStream(cached, opened, source.started), infos[shard].path)
                    try:
                        yield {"url": url, "__shard__": infos[shard].path}
                    finally:
                        left = _STREAMS.pop(url, None)  # opened by now (its reader closes it), or never will be
                        if left is not None:
                            left.close()
                    continue
                source.started()
                with cached:
                    yield {"url": cached.path, "__shard__": infos[shard].path}
        finally:
            source.close()

    def __call__(self) -> Iterator[dict[str, Any]]:
        """The stage as a WebDataset pipeline calls it.

        Returns:
            :meth:`__iter__`'s iterator.
        """
        return iter(self)


MEM_SCHEME = "shardkit-mem"  # the gopen scheme of shards read around a full cache
LANDING_SCHEME = "shardkit-landing"  # the gopen scheme of shards read while they land
_IN_MEMORY: dict[str, memoryview] = {}  # shards read around a full cache, until gopen takes them
_STREAMS: dict[str, LandingStream] = {}  # shards still landing, until gopen takes them
_numbers = itertools.count()


def _hold(registry: dict[str, Any], scheme: str, opener: Callable[..., io.BufferedReader], obj: Any,
          shard_path: str) -> str:
    """A URL of ``scheme`` that WebDataset's gopen opens (once, in this process) with ``opener``,
    which takes ``obj`` back out of ``registry``."""
    schemes = importlib.import_module("webdataset.gopen").gopen_schemes
    schemes.setdefault(scheme, opener)
    url = f"{scheme}://{os.getpid()}/{next(_numbers)}/{shard_path}"
    registry[url] = obj
    return url


def _take(registry: dict[str, Any], url: str, mode: str, why: str) -> Any:
    """What :func:`_hold` registered under ``url``, once; FileNotFoundError saying ``why`` else."""
    obj = registry.pop(url, None)
    if obj is None or mode != "rb":
        raise FileNotFoundError(f"{url}: {why}")
    return obj


def _hold_stream(stream: LandingStream, shard_path: str) -> str:
    """A URL WebDataset's gopen opens as ``stream`` (once, in this process)."""
    return _hold(_STREAMS, LANDING_SCHEME, _open_stream, stream, shard_path)


def _open_stream(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> io.BufferedReader:
    stream = _take(_STREAMS, url, mode, "a shard shardkit reads while it lands opens once, for reading, in the "
                   "process that yielded it, before the pipeline asks for the next shard")
    return io.BufferedReader(stream, buffer_size=1 << 20)


def _hold_in_memory(data: memoryview, shard_path: str) -> str:
    """A URL WebDataset's gopen opens as a stream over ``data`` (once, in this process)."""
    return _hold(_IN_MEMORY, MEM_SCHEME, _open_in_memory, data, shard_path)


def _open_in_memory(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> io.BufferedReader:
    data = _take(_IN_MEMORY, url, mode, "a shard shardkit read around a full cache opens once, for reading, in "
                 "the process that yielded it")
    return io.BufferedReader(_MemoryReader(data))


class _MemoryReader(io.RawIOBase):
    """A read-only stream over a memoryview (io.BytesIO would copy a whole shard)."""

    def __init__(self, data: memoryview) -> None:
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        out = memoryview(buf).cast("B")
        n = min(len(out), len(self._data) - self._pos)
        out[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._data = memoryview(b"")  # the shard's memory goes with the last reader of it
        super().close()
