"""A sample read again after a bad landing: who may be told it is verified, and when.

A download into a landing buffer writes the temp file as parts land, but a sample read again
after it failed its checksum reaches the buffer at once and the file only when the fill ends.
Other processes read the temp file: the progress file must not tell them of that sample until
then (they wait for the published shard). A download into a map of the temp file repairs the
file itself, and may tell them at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from shardkit.cache.progress import Progress, SampleTable
from shardkit.cache.progress_file import ProgressFile

SIZES = [1000, 2000, 1500, 800]


def setup(tmp_path: Path, landing: object | None) -> tuple[Progress, ProgressFile, bytes, int]:
    rng = np.random.default_rng(1)
    data = rng.bytes(sum(SIZES))
    offsets = np.cumsum([0, *SIZES[:-1]]).astype(np.int64)
    table = SampleTable(offsets, np.array(SIZES, np.int64),
                        np.array([xxhash.xxh3_64_intdigest(data[o:o + n]) for o, n in zip(offsets, SIZES)], np.uint64))
    bad = 2  # this sample lands with a flipped byte
    landed = bytearray(data)
    landed[int(offsets[bad]) + 7] ^= 0xFF
    temp = tmp_path / "shard.tmp"
    temp.write_bytes(bytes(landed))
    file = ProgressFile(str(tmp_path / "shard.landed"), writable=True)
    st = os.stat(temp)
    file.start(1, st, len(SIZES))
    progress = Progress("shard", table, memoryview(landed), lambda lo, hi: memoryview(data[lo:hi]), file,
                        str(temp), st, landing=landing)
    return progress, file, data, bad


@pytest.mark.parametrize("into", ["landing buffer", "map of the temp file"])
def test_a_repaired_sample_is_told_to_other_processes_only_once_the_file_holds_it(tmp_path: Path, into: str) -> None:
    progress, file, data, bad = setup(tmp_path, object() if into == "landing buffer" else None)
    progress.follow()
    progress.landed(0, len(data))
    # This process's readers have every sample, the repaired one from the buffer or map...
    assert progress.verified(np.arange(len(SIZES)))
    assert bytes(progress.view) == data
    # ...other processes, reading the temp file, the repaired one only where the file has it.
    flags = file.verified(0, len(SIZES))
    others = [p for p in range(len(SIZES)) if p != bad]
    assert all(flags[others])
    assert bool(flags[bad]) == (into == "map of the temp file")
