"""Bounded memory on the write side: extension headers in a tar source, and the keys of an iterable."""

from __future__ import annotations

import io
import itertools
import tarfile
import tracemalloc
from pathlib import Path

import pytest

import shardkit
from shardkit.errors import SourceError, UnsafeTarError
from shardkit.format.tarscan import MAX_EXTENDED_HEADER, scan_tar
from shardkit.packing.index import index_tars
from shardkit.packing.key_ledger import KeySet
from shardkit.packing.sources.iterable import samples_from_iterable


def _pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    n = len(body) + len(str(len(body)))
    n = len(body) + len(str(n))  # the length counts its own digits
    return str(n).encode() + body


def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mtime = size, kind, 1_700_000_000
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def many_pax_headers(path: Path, headers: int, each: int) -> Path:
    """A tar whose one member ``s0.txt`` is preceded by ``headers`` pax headers of ``each`` bytes."""
    with open(path, "wb") as f:
        for i in range(headers):
            record = _pax_record(f"SHARDKIT.pad{i}", "a" * (each - 40))
            f.write(_header(f"PaxHeader/{i}", len(record), tarfile.XHDTYPE) + _pad(record))
        f.write(_header("s0.txt", 5) + _pad(b"hello") + b"\0" * 1024)
    return path


def test_scanner_refuses_too_many_pax_bytes_before_a_member_naming_it_in_bounded_memory(tmp_path):
    tar = many_pax_headers(tmp_path / "pax.tar", 40, MAX_EXTENDED_HEADER - 600)  # each under the one-header bound
    tracemalloc.start()
    try:
        with open(tar, "rb") as f, pytest.raises(UnsafeTarError, match=r"pax.tar: member 's0.txt' has \d+ bytes of "
                                                                     "extension headers"):
            list(scan_tar(f, name=str(tar), file_size=tar.stat().st_size))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_EXTENDED_HEADER, peak  # was: every record held, 40 MiB


def test_pack_and_index_refuse_the_tar(tmp_path):
    (tmp_path / "src").mkdir()
    tar = many_pax_headers(tmp_path / "src" / "pax.tar", 40, MAX_EXTENDED_HEADER - 600)
    with pytest.raises(UnsafeTarError, match="member 's0.txt' has .* extension headers"):
        shardkit.pack(str(tar), str(tmp_path / "ds"), progress=False)
    assert not (tmp_path / "ds" / "dataset.json").exists()
    with pytest.raises(UnsafeTarError, match="pax.tar"):
        index_tars(str(tmp_path / "src"), progress=False)
    assert not (tmp_path / "src" / "dataset.json").exists()


def test_a_few_pax_headers_under_the_bound_still_pass(tmp_path):
    tar = many_pax_headers(tmp_path / "pax.tar", 3, 2000)
    with open(tar, "rb") as f:
        assert [m.name for m in scan_tar(f, name=str(tar), file_size=tar.stat().st_size)] == ["s0.txt"]
    buf = io.BytesIO()  # and a long name by Python's own pax writer
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("d/" + "n" * 300 + ".txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    data = buf.getvalue()
    assert [m.name for m in scan_tar(io.BytesIO(data), name="t", file_size=len(data))] == ["d/" + "n" * 300 + ".txt"]


def test_global_pax_headers_are_bounded_too():
    parts = []
    for i in range(3):
        record = _pax_record(f"SHARDKIT.g{i}", "g" * (MAX_EXTENDED_HEADER // 2))
        parts.append(_header(f"GlobalHead/{i}", len(record), tarfile.XGLTYPE) + _pad(record))
    data = b"".join(parts) + _header("s0.txt", 1) + _pad(b"x") + b"\0" * 1024
    with pytest.raises(UnsafeTarError, match="global pax headers of more than"):
        list(scan_tar(io.BytesIO(data), name="g.tar", file_size=len(data)))


# --------------------------------------------------------------------------- iterable keys


def test_key_set_bytes_per_key_is_bounded_whatever_the_key_length():
    keys = [f"{i:08d}/" + "long-directory-name/" * 10 for i in range(150_000)]  # ~210-byte keys
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        seen = KeySet()
        assert all(seen.add(k) for k in keys)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    per_key = held / len(keys)
    print(f"KeySet: {per_key:.1f} bytes/key measured, table {seen.nbytes / len(seen):.1f} bytes/key "
          f"({len(seen)} keys); a set of the key strings: ~{sum(map(len, keys)) / len(keys) + 49 + 30:.0f}")
    assert len(seen) == len(keys)
    assert per_key <= 48 and seen.nbytes / len(seen) <= 48
    assert not seen.add(keys[0]) and not seen.add(keys[-1]) and seen.add("new")
    assert seen.add("\udcff") and not seen.add("\udcff")  # undecodable bytes, surrogate-escaped


def test_iterable_duplicate_key_refused_or_skipped(tmp_path):
    items = [{"__key__": f"k{i % 5}", "txt": str(i)} for i in range(7)]  # k0, k1 repeat
    with pytest.raises(SourceError, match=r"duplicate key 'k0' in the iterable \(item 5\)"):
        shardkit.pack(iter(items), str(tmp_path / "a"), progress=False)
    info = shardkit.pack(iter(items), str(tmp_path / "b"), on_error="skip", progress=False)
    assert info["num_samples"] == 5 and [s["ref"] for s in info["skipped"]] == ["item 5", "item 6"]


def test_iterable_source_holds_its_keys_in_bounded_bytes_per_key():
    """samples_from_iterable kept every key string in a set (~290 bytes a key for these)."""
    n = 100_000
    items = ({"__key__": f"{i:08d}/" + "long-directory-name/" * 10, "txt": b"x"} for i in range(n))
    tracemalloc.start()
    try:
        gen = samples_from_iterable(items)
        next(gen)
        before = tracemalloc.get_traced_memory()[0]
        for _ in itertools.islice(gen, n - 2):  # the generator stays alive, holding what it holds
            pass
        per_key = (tracemalloc.get_traced_memory()[0] - before) / (n - 2)
    finally:
        tracemalloc.stop()
    print(f"samples_from_iterable: {per_key:.1f} bytes held per key")
    assert per_key < 64, per_key
    gen.close()
