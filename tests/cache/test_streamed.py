"""Shards read while they land (``ShardCache.open(stream=True)``): a sample is served once its own
bytes are in and match its xxh3-64, long before the shard's last byte; a corrupt sample is read
again or ends in one error, never served; the file counts as cached only after the whole-shard
check; other processes follow a download through its progress file; a reader killed mid-shard
leaves a cache the next reader uses as if nothing happened.

Local files stand in for the object store (cachefakes); the tail of each shard is held back by
a gate (an Event in this process, a file for others) so "before the last byte" is a fact, not
a timing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from cachefakes import NS, FnReader, make_store, wait_for
from cachewalk import cache_files, limited
from shardkit.cache.files import ShardRef
from shardkit.cache.progress import INFLIGHT, SampleTable
from shardkit.cache.progress_file import progress_file_size
from shardkit.cache.shard_cache import CachedShard, LandingShard, ShardCache
from shardkit.errors import IntegrityError
from shardkit.read.held import open_held
from shardkit.storage.ranged import PartCallback

pytestmark = pytest.mark.timeout(120)
SPAWN = mp.get_context("spawn")


@pytest.fixture(scope="module", autouse=True)
def resource_tracker() -> None:
    """Start multiprocessing's per-session helper before the leak police takes its snapshot."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()

PART = 64 << 10
GATES: dict[str, threading.Event] = {}  # gate name -> event, for gates of this process


def samples_of(data: bytes, seed: int = 1) -> SampleTable:
    """Cut ``data`` into samples of 5-40 KB back to back, leaving its last 1 KB in no sample (as
    a tar's end), with their xxh3-64s."""
    rng = np.random.default_rng(seed)
    offsets, sizes = [], []
    pos = 0
    while True:
        size = int(rng.integers(5_000, 40_000))
        if pos + size > len(data) - 1024:
            break
        offsets.append(pos)
        sizes.append(size)
        pos += size
    checks = [xxhash.xxh3_64_intdigest(data[o:o + n]) for o, n in zip(offsets, sizes)]
    return SampleTable(np.array(offsets, np.int64), np.array(sizes, np.int64), np.array(checks, np.uint64))


@dataclass(frozen=True)
class Gated:
    """A parallel reader of the fake store (picklable): parts land front to back, two at a time;
    parts from ``gate_at`` on wait until the gate opens (an Event of this process, or the file
    ``gate_file`` for other processes); ``flip_at``: that byte comes flipped on the shard's read
    (``flip_always``: on every read, a sample read again too; ``flip_once``: on the first only)."""

    src: str
    log: str
    gate_at: int = 1 << 62
    gate: str = ""
    gate_file: str = ""
    flip_at: int | None = None
    flip_always: bool = False
    flip_once: str = ""  # flip only on the first read of the shard: this file marks it done
    gate2_at: int = 1 << 62  # parts from here on also wait for the file gate2_file
    gate2_file: str = ""

    def data(self, name: str) -> bytes:
        return (Path(self.src) / name.replace("/", "_")).read_bytes()

    def reads(self) -> list[tuple[int, int]]:
        if not os.path.exists(self.log):
            return []
        return [(int(a), int(b)) for a, b in (ln.split() for ln in Path(self.log).read_text().splitlines())]

    def _wait_gate(self) -> None:
        if self.gate_file:
            wait_for(lambda: os.path.exists(self.gate_file), timeout=100)
        elif self.gate:
            assert GATES[self.gate].wait(100)

    def __call__(self, ref: ShardRef) -> FnReader:
        def read_into(start: int, out: memoryview, on_part: PartCallback | None = None) -> int:
            with open(self.log, "a") as f:
                f.write(f"{start} {len(out)}\n")
            data = self.data(ref.name)
            end = min(len(data), start + len(out))
            flip = self.flip_at is not None
            if self.flip_once and start == 0 and end == len(data):
                flip = not os.path.exists(self.flip_once)
                Path(self.flip_once).touch()

            def one(lo: int) -> None:
                hi = min(end, lo + PART)
                if lo >= self.gate_at:
                    self._wait_gate()
                if lo >= self.gate2_at:
                    wait_for(lambda: os.path.exists(self.gate2_file), timeout=100)
                out[lo - start:hi - start] = data[lo:hi]
                whole_shard = start == 0 and end == len(data)
                if flip and self.flip_at is not None and lo <= self.flip_at < hi and (whole_shard or self.flip_always):
                    out[self.flip_at - start] ^= 0xFF
                if on_part is not None:
                    on_part(lo, hi)

            with ThreadPoolExecutor(2) as pool:
                for fut in [pool.submit(one, lo) for lo in range(start, end, PART)]:
                    fut.result()
            return end - start
        return FnReader(read_into, parallel=True)


def setup(tmp_path: Path, size: int = 1 << 20, **kw: Any) -> tuple[Any, ShardRef, Gated, bytes]:
    s = make_store(tmp_path, [size])
    ref = s.refs[0]
    reader = Gated(s.remote.src, str(tmp_path / "reads.log"), **kw)
    data = reader.data(ref.name)
    return s, replace(ref, samples=samples_of(data)), reader, data


def samples(ref: ShardRef) -> SampleTable:
    """The shard's sample table (setup() always gives one)."""
    assert ref.samples is not None
    return ref.samples


def span(table: SampleTable, p: int) -> tuple[int, int]:
    """(offset, size) of sample ``p``'s bytes in the shard."""
    return int(table.offsets[p]), int(table.sizes[p])


def sample_bytes(shard: CachedShard | LandingShard, table: SampleTable, p: int) -> bytes:
    start, size = span(table, p)
    return os.pread(shard.fileno(), size, start)


@pytest.fixture
def gate() -> Any:
    name = f"g{len(GATES)}"
    GATES[name] = threading.Event()
    yield name
    GATES.pop(name).set()


def test_a_sample_is_served_before_the_shards_last_byte_lands(tmp_path: Path, gate: str) -> None:
    s, ref, reader, data = setup(tmp_path, gate_at=512 << 10, gate=gate)
    table = samples(ref)
    first = np.arange(5)
    last = len(table) - 1
    with s.cache(100 << 20) as cache:
        shard = cache.open(ref, reader, stream=True)
        assert isinstance(shard, LandingShard)
        assert shard.wait(first)  # the gate holds everything from 512 KiB on back
        for p in first.tolist():
            assert sample_bytes(shard, table, p) == data[table.offsets[p]:table.offsets[p] + table.sizes[p]]
            assert bytes(shard.buffer()[table.offsets[p]:table.offsets[p] + table.sizes[p]]) == \
                data[table.offsets[p]:table.offsets[p] + table.sizes[p]]
        assert not shard._local.verified(np.array([last]))  # type: ignore[union-attr]
        assert not cache.contains(ref) and not s.final(ref).exists()  # not cached for anyone yet
        assert cache.stats()["streamed"] == 1
        GATES[gate].set()
        assert shard.wait(np.array([last])) or cache.contains(ref)
        shard.close()
        wait_for(lambda: cache.contains(ref))
        with cache.open(ref, reader, stream=True) as whole:
            assert isinstance(whole, CachedShard) and whole.verified
            assert bytes(whole.buffer()) == data
    assert reader.reads() == [(0, len(data))]  # one read of the shard, nothing twice


def test_a_flipped_byte_is_read_again_and_never_served(tmp_path: Path, gate: str) -> None:
    s, ref, _, data = setup(tmp_path)
    table, p = samples(ref), 7
    lo, n = span(table, p)
    # The tail waits until the reader has its sample: it follows the download while it lands.
    reader = Gated(s.remote.src, str(tmp_path / "reads.log"), flip_at=lo + n // 2, gate_at=512 << 10, gate=gate)
    with s.cache(100 << 20) as cache:
        with cache.open(ref, reader, stream=True) as shard:
            assert isinstance(shard, LandingShard)
            assert shard.wait(np.array([p]))
            assert sample_bytes(shard, table, p) == data[lo:lo + n]
            GATES[gate].set()
        wait_for(lambda: cache.contains(ref))
        with cache.open(ref, reader) as whole:
            assert bytes(whole.buffer()) == data  # the refetched sample went into the file too
        assert cache.stats()["misses"] == 1
    # The shard once, then that one sample again: no second download of the shard.
    assert reader.reads() == [(0, len(data)), (lo, n)]


def test_a_sample_corrupt_on_every_read_is_one_clear_error(tmp_path: Path, gate: str) -> None:
    s, ref, _, data = setup(tmp_path)
    table, p = samples(ref), 7
    lo, n = span(table, p)
    reader = Gated(s.remote.src, str(tmp_path / "reads.log"), flip_at=lo + 3, flip_always=True, gate_at=512 << 10,
                   gate=gate)
    with s.cache(100 << 20) as cache:
        shard = cache.open(ref, reader, stream=True)
        assert isinstance(shard, LandingShard)
        assert shard.wait(np.arange(p))  # the samples before it are served...
        good = [sample_bytes(shard, table, q) for q in range(p)]
        GATES[gate].set()
        assert not shard.wait(np.array([p]))  # ...that one never is
        assert isinstance(shard.error, IntegrityError) and f"bytes [{lo}, {lo + n})" in str(shard.error)
        assert "fails its checksum on each of 3 reads" in str(shard.error)
        assert good == [data[table.offsets[q]:table.offsets[q] + table.sizes[q]] for q in range(p)]
        shard.close()
        with pytest.raises(IntegrityError, match="fails its checksum on each of 3 reads"):
            cache.open(ref, reader, stream=True)  # remembered: not fetched once more
        with pytest.raises(IntegrityError, match="does not match the manifest"):
            cache.open(ref, reader)  # and the ordinary open (nobody follows it) fails the whole-shard check
        assert not cache.contains(ref) and not s.final(ref).exists()


def test_the_file_is_cached_only_after_the_whole_shard_checks_out(tmp_path: Path, gate: str) -> None:
    s, ref, _, data = setup(tmp_path)
    table = samples(ref)
    # A byte no sample holds (the archive's end) comes flipped on every read: each sample checks
    # out, the whole shard never does.
    reader = Gated(s.remote.src, str(tmp_path / "reads.log"), flip_at=len(data) - 10, flip_always=True,
                   gate_at=len(data) - PART, gate=gate)
    everyone = np.arange(len(table))
    with s.cache(100 << 20) as cache:
        shard = cache.open(ref, reader, stream=True)
        assert isinstance(shard, LandingShard)
        assert shard.wait(everyone[everyone < len(table) - 3])
        assert not cache.contains(ref)
        GATES[gate].set()
        shard.close()
        with pytest.raises(IntegrityError, match="does not match the manifest .* twice"):
            cache.open(ref, reader)  # waits for the streamed download's two attempts, then fails its own two
        assert not cache.contains(ref) and not s.final(ref).exists()
        assert list((Path(s.cache_dir) / NS / ".tmp").iterdir()) == []


def other_process_reads(cache_dir: str, ref: ShardRef, reader: Gated, want: list[int], conn: Any) -> None:
    """In a spawned process: open the shard while another process's download is held back, ask
    it to verify samples as they land, let more of it come (``reader.gate_file``: the download
    hears of the ask at its next part), read samples ``want`` and send (whether it was still
    landing, whether it was cached, their bytes)."""
    cache = ShardCache(cache_dir, 100 << 20, namespace=NS)
    shard = cache.open(ref, reader, stream=True)
    landing = isinstance(shard, LandingShard)
    Path(reader.gate_file).touch()
    ok = shard.wait(np.array(want)) if isinstance(shard, LandingShard) else True
    assert ref.samples is not None
    conn.send((landing, ok, cache.contains(ref), [sample_bytes(shard, ref.samples, p) for p in want]))
    shard.close()
    cache.close()


def test_another_process_reads_the_samples_landed_so_far(tmp_path: Path) -> None:
    """This process prefetches the shard (nobody reads it here, so nothing is hashed sample by
    sample); another process opens it while it lands, asks for its samples, reads them."""
    gate_file, tail = tmp_path / "gate", tmp_path / "tail"
    s, ref, reader, data = setup(tmp_path, gate_at=512 << 10, gate_file=str(gate_file), gate2_at=768 << 10,
                                 gate2_file=str(tail))
    table = samples(ref)
    with s.cache(100 << 20) as cache:
        cache.prefetch([ref], reader, max_ahead=1)
        wait_for(lambda: (p := INFLIGHT.get(str(s.final(ref)))) is not None and p.landed_bytes >= 512 << 10)
        progress = INFLIGHT.get(str(s.final(ref)))
        assert progress is not None and not progress.flags().any()  # fetched ahead of any reader: not hashed yet
        mine, theirs = SPAWN.Pipe()
        child = SPAWN.Process(target=other_process_reads, args=(s.cache_dir, ref, reader, [0, 1, 2], theirs))
        child.start()
        assert mine.poll(60)
        landing, ok, cached, got = mine.recv()
        child.join(30)
        assert (landing, ok, cached) == (True, True, False)  # served from the download in flight here
        assert got == [data[table.offsets[p]:table.offsets[p] + table.sizes[p]] for p in range(3)]
        assert progress.flags()[:3].all()
        tail.touch()
        wait_for(lambda: cache.contains(ref))
    assert reader.reads() == [(0, len(data))]  # the other process fetched nothing


def test_a_reader_that_joins_a_download_gets_what_landed_verified_at_once(tmp_path: Path, gate: str) -> None:
    s, ref, reader, data = setup(tmp_path, gate_at=512 << 10, gate=gate)
    table = samples(ref)
    with s.cache(100 << 20) as cache:
        cache.prefetch([ref], reader, max_ahead=1)
        wait_for(lambda: (p := INFLIGHT.get(str(s.final(ref)))) is not None and p.landed_bytes >= 512 << 10)
        progress = INFLIGHT.get(str(s.final(ref)))
        assert progress is not None and not progress.flags().any()
        with cache.open(ref, reader, stream=True) as shard:  # follows it: what landed is checked now
            assert isinstance(shard, LandingShard)
            before = int(np.searchsorted(table.offsets + table.sizes, 512 << 10, side="right"))
            assert before > 3 and progress.flags()[:before].all() and not progress.flags()[before + 1:].any()
            assert shard.wait(np.arange(before))
            GATES[gate].set()
            assert shard.wait(np.arange(len(table))) or cache.contains(ref)
        wait_for(lambda: cache.contains(ref))
        with cache.open(ref, reader) as whole:
            assert bytes(whole.buffer()) == data
    assert reader.reads() == [(0, len(data))]


def download_and_hang(cache_dir: str, ref: ShardRef, reader: Gated, conn: Any) -> None:
    """In a spawned process: start the download (its tail gated for good), say so, wait to be killed."""
    cache = ShardCache(cache_dir, 100 << 20, namespace=NS)
    shard = cache.open(ref, reader, stream=True)
    assert isinstance(shard, LandingShard) and shard.wait(np.array([0]))
    conn.send("landing")
    threading.Event().wait(100)


def test_a_reader_killed_mid_shard_leaves_the_cache_consistent(tmp_path: Path, gate: str) -> None:
    s, ref, reader, data = setup(tmp_path)
    hung = replace(reader, gate_at=256 << 10, gate_file=str(tmp_path / "never"))
    reader = replace(reader, gate_at=512 << 10, gate=gate)  # this process's download: held until it follows
    mine, theirs = SPAWN.Pipe()
    child = SPAWN.Process(target=download_and_hang, args=(s.cache_dir, ref, hung, theirs))
    child.start()
    assert mine.poll(60) and mine.recv() == "landing"
    progress = Path(s.cache_dir) / NS / ".locks" / (s.final(ref).name + ".landed")
    assert progress.stat().st_size > 0  # its progress file says it is landing
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    table = samples(ref)
    with s.cache(100 << 20) as cache:
        shard = cache.open(ref, reader, stream=True)  # the dead download's file and progress are not trusted
        assert isinstance(shard, LandingShard)
        GATES[gate].set()
        assert shard.wait(np.arange(len(table)))
        assert all(sample_bytes(shard, table, p) == data[table.offsets[p]:table.offsets[p] + table.sizes[p]]
                   for p in range(len(table)))
        shard.close()
        wait_for(lambda: cache.contains(ref))
        with cache.open(ref, reader) as whole:
            assert bytes(whole.buffer()) == data
    assert list((Path(s.cache_dir) / NS / ".tmp").iterdir()) == []
    assert progress.stat().st_size == 0


def test_a_failed_attempt_keeps_what_its_readers_hold_and_the_next_one_lands_anew(tmp_path: Path,
                                                                                 gate: str) -> None:
    """The first attempt's whole-shard check fails (a byte no sample holds, flipped once): its
    readers keep reading what they were told is verified, from an inode the retry never touches."""
    s, ref, _, data = setup(tmp_path)
    table = samples(ref)
    once = Gated(s.remote.src, str(tmp_path / "reads.log"), flip_at=len(data) - 10, flip_once=str(tmp_path / "flipped"),
                 gate_at=len(data) - PART, gate=gate)

    with s.cache(100 << 20) as cache:
        shard = cache.open(ref, once, stream=True)
        assert isinstance(shard, LandingShard) and shard.wait(np.arange(4))
        held = [bytes(shard.buffer()[table.offsets[p]:table.offsets[p] + table.sizes[p]]) for p in range(4)]
        ino = os.fstat(shard.fileno()).st_ino
        GATES[gate].set()
        wait_for(lambda: cache.contains(ref))
        assert os.stat(s.final(ref)).st_ino != ino  # the second attempt filled a new inode
        assert [bytes(shard.buffer()[table.offsets[p]:table.offsets[p] + table.sizes[p]]) for p in range(4)] == held
        assert held == [data[table.offsets[p]:table.offsets[p] + table.sizes[p]] for p in range(4)]
        shard.close()
        with cache.open(ref, once) as whole:
            assert bytes(whole.buffer()) == data


def test_a_download_mostly_landed_is_waited_for_whole_not_followed(tmp_path: Path, gate: str) -> None:
    """Past join_below, a reader would wait for the rest of the shard anyway: it does, without
    having the download hash its samples, and opens the published file."""
    s, ref, reader, data = setup(tmp_path, gate_at=(1 << 20) - 2 * PART, gate=gate)
    with s.cache(100 << 20) as cache:
        cache.prefetch([ref], reader, max_ahead=1)
        wait_for(lambda: (p := INFLIGHT.get(str(s.final(ref)))) is not None and p.landed_bytes >= (1 << 20) - 2 * PART)
        progress = INFLIGHT.get(str(s.final(ref)))
        assert progress is not None
        threading.Timer(0.3, GATES[gate].set).start()  # the tail lands while the open waits
        with cache.open(ref, reader, stream=True, join_below=0.5) as shard:
            assert isinstance(shard, CachedShard) and shard.verified and bytes(shard.buffer()) == data
        assert not progress.flags().any() and cache.stats()["streamed"] == 0  # nothing hashed sample by sample
        with cache.open(ref, reader, stream=True) as again:  # published: an ordinary hit either way
            assert isinstance(again, CachedShard)


def test_sequential_readers_and_shards_without_samples_open_as_before(tmp_path: Path) -> None:
    s, ref, reader, data = setup(tmp_path)
    with s.cache(100 << 20) as cache:
        with cache.open(ref, s.remote, stream=True) as shard:  # a sequential reader: the whole shard first
            assert isinstance(shard, CachedShard) and bytes(shard.buffer()) == data
    (tmp_path / "b").mkdir()
    s2, ref2, reader2, data2 = setup(tmp_path / "b")
    with s2.cache(100 << 20) as cache:
        with cache.open(replace(ref2, samples=None), reader2, stream=True) as shard:
            assert isinstance(shard, CachedShard) and bytes(shard.buffer()) == data2
        assert cache.stats()["streamed"] == 0



def test_view_readers_do_not_read_a_shard_landing_in_a_buffer_of_this_process(tmp_path: Path, gate: str) -> None:
    # A copying reader's download lands in a buffer and writes the file behind it; a reader of
    # views (zero-copy, per-sample) of the same shard in this process waits for the whole shard.
    s, ref, reader, data = setup(tmp_path, gate_at=512 << 10, gate=gate)
    table = samples(ref)
    first = np.arange(3)
    with s.cache(100 << 20) as cache:
        copier = cache.open(ref, reader, stream=True, landing=True)
        assert isinstance(copier, LandingShard) and copier.hot is not None
        assert copier.wait(first)
        with ThreadPoolExecutor(1) as pool:
            viewer = pool.submit(open_held, cache, ref, reader, first, 0, landing=False, stream=True, keep_map=False)
            with pytest.raises(TimeoutError):
                viewer.result(timeout=0.5)  # not served from the landing file
            GATES[gate].set()
            held = viewer.result(timeout=30)
        assert isinstance(held.handle, CachedShard) and held.handle.verified
        assert bytes(held.view) == data
        held.close()
        copier.close()


def _on_disk(cache_dir: str) -> int:
    """Bytes of the files cache_limit bounds at one moment (progress files included)."""
    return sum(st.st_size for _, st in limited(cache_files(cache_dir)))


def gated_shards(tmp_path: Path, gate: str, count: int) -> tuple[Any, Gated, list[ShardRef]]:
    """``count`` shards of 600 KiB in the fake store with their samples known, and a reader whose
    parts from 256 KiB on wait for ``gate``."""
    s = make_store(tmp_path, [600 << 10] * count)
    reader = Gated(s.remote.src, str(tmp_path / "reads.log"), gate_at=256 << 10, gate=gate)
    return s, reader, [replace(r, samples=samples_of(reader.data(r.name))) for r in s.refs]


def cache_whole(cache: ShardCache, ref: ShardRef, reader: Gated, gate: str) -> None:
    """Land ``ref`` whole in ``cache`` (the gate open for it), then close the gate again."""
    GATES[gate].set()
    with cache.open(ref, reader, stream=True):
        pass
    wait_for(lambda: cache.contains(ref))
    GATES[gate].clear()


def test_progress_files_count_under_cache_limit(tmp_path: Path, gate: str) -> None:
    """cache_limit bounds the shards, the downloads and their progress files together: a limit
    with room for two shards but not for two and a progress file evicts the first shard to
    download the second."""
    s, reader, (a, b) = gated_shards(tmp_path, gate, 2)
    limit = a.size + b.size + progress_file_size(len(samples(b))) - 1
    with s.cache(limit) as cache:
        cache_whole(cache, a, reader, gate)
        shard = cache.open(b, reader, stream=True)
        assert isinstance(shard, LandingShard)
        assert shard.wait(np.arange(3))  # b lands up to the gate: its temp file and progress file are there
        on_disk = _on_disk(s.cache_dir)
        assert on_disk <= limit, f"{on_disk} bytes on disk over cache_limit {limit}"
        assert not cache.contains(a)  # a was evicted to make the room
        GATES[gate].set()
        shard.close()
        wait_for(lambda: cache.contains(b))
        assert _on_disk(s.cache_dir) <= limit


def test_a_progress_file_a_killed_downloader_left_is_emptied_not_counted(tmp_path: Path, gate: str) -> None:
    """A progress file left non-empty (its downloader was killed; nobody holds its download lock)
    is emptied when room is reserved, instead of keeping that room from a tight cache; one whose
    download is in flight is left alone."""
    s, reader, (a, b, c) = gated_shards(tmp_path, gate, 3)
    limit = a.size + b.size + progress_file_size(len(samples(b)))  # a, and b with its progress file
    with s.cache(limit) as cache:
        cache_whole(cache, a, reader, gate)
        locks = Path(s.cache_dir) / NS / ".locks"
        left = locks / "shards%2Fshard-000002.tar.landed"  # c's, as a killed downloader leaves it
        left.write_bytes(bytes(progress_file_size(len(samples(c)))))
        shard = cache.open(b, reader, stream=True)
        assert shard.wait(np.arange(3))
        assert left.stat().st_size == 0  # emptied...
        assert cache.contains(a)  # ...so a kept its room
        assert (locks / "shards%2Fshard-000001.tar.landed").stat().st_size > 0  # b's, in flight
        assert _on_disk(s.cache_dir) <= limit
        GATES[gate].set()
        shard.close()
        wait_for(lambda: cache.contains(b))


def test_a_limit_of_one_shard_keeps_no_progress_file(tmp_path: Path, gate: str) -> None:
    """A cache_limit of exactly one shard has no room for a progress file beside it: the download
    goes without one (other processes wait for the published shard), and the limit holds."""
    s, ref, reader, data = setup(tmp_path, size=600 << 10, gate_at=256 << 10, gate=gate)
    with s.cache(ref.size) as cache:
        shard = cache.open(ref, reader, stream=True)
        assert shard.wait(np.arange(3))  # this process's readers still get samples as they land
        assert _on_disk(s.cache_dir) <= ref.size
        assert not [rel for rel, st in cache_files(s.cache_dir) if rel.endswith(".landed") and st.st_size]
        GATES[gate].set()
        shard.close()
        wait_for(lambda: cache.contains(ref))
        with cache.open(ref, reader) as whole:
            assert bytes(whole.buffer()) == data
