"""``shardkit index``: manifests for existing WebDataset tars, in place, local and on S3."""

from __future__ import annotations

import io
import re
import tarfile
from typing import Any

import pytest

import shardkit
from shardkit.cli import main as cli_main
from shardkit.errors import DatasetExistsError, SourceError, UnsafeTarError
from shardkit.packing.index import index_tars

LONG = "deep/" + "d" * 110 + "/v1.2/" + "long_sample_name_" * 8  # > 100 chars: pax header


def _tarfile_bytes(members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _wds_bytes(samples: list[dict[str, Any]]) -> bytes:
    wds = pytest.importorskip("webdataset")
    buf = io.BytesIO()
    with wds.TarWriter(buf) as w:
        for s in samples:
            w.write(s)
    return buf.getvalue()


def _expected(data: bytes) -> dict[str, dict[str, bytes]]:
    """key -> field -> bytes, by Python's tarfile (the reference reader), keyed as the
    webdataset library keys them (a leading ``./`` kept)."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for m in tf:
            if m.isfile():
                head, _, base = m.name.rpartition("/")
                stem, _, field = base.partition(".")
                out.setdefault(f"{head}/{stem}" if head else stem, {})[field] = tf.extractfile(m).read()  # type: ignore[union-attr]
    return out


def _webdataset(path: str) -> list[tuple[str, dict[str, bytes]]]:
    """(key, fields) of every sample the webdataset library reads from one local tar."""
    wds = pytest.importorskip("webdataset")
    return [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
            for s in wds.WebDataset(path, shardshuffle=False)]


def _readers(url: str, cache_dir: Any = None) -> list[tuple[str, dict[str, bytes]]]:
    """(key, fields) of every sample by each shardkit reader, checked to agree."""
    def plain(s: dict[str, Any]) -> tuple[str, dict[str, bytes]]:
        return s["__key__"], {k: bytes(v) for k, v in s.items() if not k.startswith("__")}

    streamed = [plain(s) for s in shardkit.StreamingDataset(url)]
    if cache_dir is not None:  # whole shards fetched into the node cache, samples sliced from them
        assert [plain(s) for s in shardkit.StreamingDataset(url, cache_dir=cache_dir)] == streamed
    ra = shardkit.ShardDataset(url)
    assert [plain(ra[i]) for i in range(len(ra))] == streamed
    assert [plain(ra.by_key(k)) for k, _ in streamed] == streamed
    return streamed


def _tars() -> dict[str, bytes]:
    big = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4: not a block multiple
    return {
        "a-000.tar": _wds_bytes([{"__key__": f"s{i:03d}", "jpg": bytes([i]) * (700 + i), "cls": str(i % 3).encode(),
                                  "json": b'{"i": %d}' % i} for i in range(12)]),
        "a-001.tar": _tarfile_bytes([(f"{LONG}.npy", big), (f"{LONG}.txt", b"caption"),
                                     ("dir.with.dots/x.seg.png", b"P" * 1500), ("dir.with.dots/x.cls", b"1"),
                                     ("./plain.bin", b"")]),
        "a-002.tar": _tarfile_bytes([("gnu/" + "g" * 120 + ".txt", b"gnu long name")], fmt=tarfile.GNU_FORMAT),
    }


def _put(root: str, files: dict[str, bytes], opts: dict[str, Any] | None = None) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(root, **(opts or {}))
    for name, data in files.items():
        fs.makedirs(fs._parent(f"{path}/{name}"), exist_ok=True)
        fs.pipe_file(f"{path}/{name}", data)


def _check(url: str, tars: dict[str, bytes], opts: dict[str, Any] | None = None, prefix: str = "") -> Any:
    ds = shardkit.open_dataset(url, storage_options=opts)
    ds.verify(deep=True)
    assert ds.shards.column("path").to_pylist() == [prefix + n for n in sorted(tars)]
    assert ds.shards.column("bytes").to_pylist() == [len(tars[n]) for n in sorted(tars)]
    got = {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")} for s in ds.iter_samples()}
    want: dict[str, dict[str, bytes]] = {}
    for name in sorted(tars):
        want.update(_expected(tars[name]))
    assert got == want
    # field offsets point at the member bodies in the original tars
    for row in ds.samples.to_pylist():
        data = tars[ds.shard_list[row["shard"]].path[len(prefix):]]
        for f in row["fields"]:
            assert data[f["offset"]:f["offset"] + f["size"]] == want[row["key"]][f["name"]]
        assert tarfile.open(fileobj=io.BytesIO(data[row["offset"]:row["offset"] + row["size"]] + b"\0" * 1024))
    return ds


def test_index_local_tarwriter_and_tarfile(tmp_path):
    tars = _tars()
    _put(str(tmp_path), tars)
    info = index_tars(str(tmp_path), progress=False)
    assert info["num_shards"] == 3 and info["num_samples"] == 12 + 3 + 1
    ds = _check(str(tmp_path), tars)
    assert "dir.with.dots/x" in ds.samples.column("key").to_pylist()
    assert {"seg.png", "npy", "jpg"} <= set(ds.fields)


def test_index_reads_tars_in_subfolders_too(tmp_path):
    tars = _tars()
    _put(str(tmp_path), {"a-000.tar": tars["a-000.tar"], "nested/deeper/a-001.tar": tars["a-001.tar"],
                         "nested/a-002.tar": tars["a-002.tar"]})
    info = index_tars(str(tmp_path), progress=False)
    assert info["num_shards"] == 3 and info["num_samples"] == 12 + 3 + 1
    _check(str(tmp_path), {"a-000.tar": tars["a-000.tar"], "nested/a-002.tar": tars["a-002.tar"],
                           "nested/deeper/a-001.tar": tars["a-001.tar"]})


@pytest.mark.s3
def test_index_on_s3_under_shards(s3_server, s3_bucket, s3_env):
    tars = _tars()
    opts = s3_server.storage_options()
    _put(f"{s3_bucket}/wds", {f"shards/{k}": v for k, v in tars.items()}, opts)
    assert cli_main(["index", f"{s3_bucket}/wds", "--quiet"]) == 0  # credentials from AWS_* env
    _check(f"{s3_bucket}/wds", tars, opts, prefix="shards/")


@pytest.mark.parametrize("fragment_rows", [250_000, 7])
def test_index_matches_pack(tmp_path, monkeypatch, fragment_rows):
    """On shards shardkit wrote, index records exactly the manifest pack recorded; also when
    the sample rows are written as many fragments (as at 250,000 rows on big datasets)."""
    from shardkit.packing import index

    monkeypatch.setattr(index, "FRAGMENT_ROWS", fragment_rows)
    samples = [{"__key__": f"k{i:04d}", "bin": bytes([i % 251]) * (100 + 37 * i), "cls": i % 5} for i in range(50)]
    shardkit.pack(samples, str(tmp_path / "packed"), shard_bytes="20KB", progress=False)
    (tmp_path / "idx").mkdir()
    for p in sorted((tmp_path / "packed" / "shards").iterdir()):
        (tmp_path / "idx" / p.name).write_bytes(p.read_bytes())
    index_tars(str(tmp_path / "idx"), progress=False)
    a, b = shardkit.open_dataset(str(tmp_path / "packed")), shardkit.open_dataset(str(tmp_path / "idx"))
    cols = ["key", "shard", "offset", "size", "fields", "checksum"]
    assert a.samples.select(cols).equals(b.samples.select(cols))
    scols = ["shard", "num_samples", "bytes", "first_sample", "checksum"]
    assert a.shards.select(scols).equals(b.shards.select(scols))
    assert b.shards.column("path").to_pylist() == [p.split("/")[-1] for p in a.shards.column("path").to_pylist()]
    fragments = len(set(b.shards.column("samples_file").to_pylist()))
    if fragment_rows > 50:
        assert fragments == 1
    else:
        assert fragments > 1
        b.verify(deep=True)
        got = {s["__key__"]: bytes(s["bin"]) for s in shardkit.StreamingDataset(str(tmp_path / "idx"))}
        assert got == {s["__key__"]: s["bin"] for s in samples}


def test_index_records_the_block_checksums_pack_records(tmp_path):
    import numpy as np
    import pyarrow.parquet as pq

    from shardkit.format.checksums import BLOCK_BYTES

    rng = np.random.default_rng(0)
    samples = [{"__key__": f"k{i}", "npy": rng.random(n), "cls": i} for i, n in enumerate((10, 400_000, 50))]
    shardkit.pack(samples, str(tmp_path / "packed"), progress=False)
    (tmp_path / "idx").mkdir()
    for p in sorted((tmp_path / "packed" / "shards").iterdir()):
        (tmp_path / "idx" / p.name).write_bytes(p.read_bytes())
    index_tars(str(tmp_path / "idx"), progress=False)
    a, b = shardkit.open_dataset(str(tmp_path / "packed")), shardkit.open_dataset(str(tmp_path / "idx"))
    blocks = a.samples.column("block_checksums").to_pylist()
    assert blocks[0] is None and blocks[2] is None and len(blocks[1]) == 4  # 3.2 MB: four 1 MiB blocks
    assert b.samples.column("block_checksums").to_pylist() == blocks
    for root in ("packed", "idx"):
        meta = pq.read_schema(next((tmp_path / root / "manifest").glob("samples-*.parquet"))).metadata
        assert meta[b"shardkit.block_bytes"] == str(BLOCK_BYTES).encode()


def _hostile(kind: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ok = tarfile.TarInfo("good.txt")
        ok.size = 2
        tf.addfile(ok, io.BytesIO(b"ok"))
        if kind == "symlink":
            link = tarfile.TarInfo("evil.txt")
            link.type = tarfile.SYMTYPE
            link.linkname = "/etc/passwd"
            tf.addfile(link)
        else:
            bad = tarfile.TarInfo("../evil.txt")
            bad.size = 1
            tf.addfile(bad, io.BytesIO(b"x"))
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["symlink", "dotdot", "size"])
def test_hostile_tar_refused_nothing_committed(tmp_path, kind):
    data = _hostile(kind) if kind != "size" else _truncated()
    _put(str(tmp_path), {"a.tar": _tarfile_bytes([("fine.txt", b"fine")]), "b.tar": data})
    with pytest.raises(UnsafeTarError, match="evil"):
        index_tars(str(tmp_path), progress=False)
    assert not (tmp_path / "dataset.json").exists()
    assert not (tmp_path / "manifest").exists()
    assert cli_main(["index", str(tmp_path), "--quiet"]) == 1


@pytest.mark.parametrize("name", [".jpg", "dir/.jpg", "./.cls", "README", "__meta__", "__meta__/x.jpg", "._fine.txt"])
def test_member_without_a_key_is_skipped(tmp_path, name, caplog, capsys):
    """Members the webdataset library skips (no key and field, ``__*__`` metadata, hidden
    names) are left out, counted and named once, not a reason to refuse the collection."""
    _put(str(tmp_path), {"a.tar": _tarfile_bytes([("fine.txt", b"fine"), (name, b"x")])})
    with caplog.at_level("WARNING", logger="shardkit"):
        info = index_tars(str(tmp_path), progress=False)
    assert info["num_samples"] == 1 and info["index"]["skipped_members"] == 1
    assert info["skipped"] == [{"ref": "a.tar", "key": "", "reason": f"1 members the webdataset library skips too, "
                                                                     f"first {name!r}"}]
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "skipped 1 members in 1 tars" in line and repr(name) in line and "a.tar" in line
    assert [bytes(s["txt"]) for s in shardkit.StreamingDataset(str(tmp_path))] == [b"fine"]
    capsys.readouterr()
    assert cli_main(["info", str(tmp_path)]) == 0
    assert "skipped   1 tar members (in 1 tars) that the webdataset library skips too" in capsys.readouterr().out


@pytest.mark.parametrize("name, problem", [("0001.", "empty field name"), ("0001.a\\b", "backslash in its field name"),
                                           ("0001.a\nb", "control character"), ("00\x1b1.jpg", "control character")])
def test_unreadable_field_names_are_refused(tmp_path, name, problem):
    _put(str(tmp_path), {"a.tar": _tarfile_bytes([("0000.txt", b"0"), (name, b"x")])})
    with pytest.raises(SourceError, match=re.escape(f"a.tar: member {name!r} ") + ".*" + re.escape(problem)):
        index_tars(str(tmp_path), progress=False)
    assert not (tmp_path / "dataset.json").exists()


def test_long_link_target_error_names_the_member(tmp_path):
    # A GNU long link target (././@LongLink record) was reported as the member '././@LongLink'.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        info = tarfile.TarInfo("0001.jpg")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
        link = tarfile.TarInfo("0002.jpg")
        link.type = tarfile.SYMTYPE
        link.linkname = "/" + "z" * 150
        tf.addfile(link)
    _put(str(tmp_path), {"a.tar": buf.getvalue()})
    with pytest.raises(UnsafeTarError, match=r"a\.tar: member '0002\.jpg' is a symlink; refused") as err:
        index_tars(str(tmp_path), progress=False)
    assert "LongLink" not in str(err.value)
    assert not (tmp_path / "dataset.json").exists()


def _truncated() -> bytes:
    """A header that claims 1 GB of data in a file of a few KB."""
    head = tarfile.TarInfo("evil.bin")
    head.size = 10**9
    return _tarfile_bytes([("good.txt", b"ok")])[:1024] + head.tobuf(tarfile.PAX_FORMAT) + b"z" * 4096


def test_existing_dataset_refused_unless_overwrite(tmp_path):
    tars = _tars()
    _put(str(tmp_path), tars)
    first = index_tars(str(tmp_path), progress=False)
    with pytest.raises(DatasetExistsError):
        index_tars(str(tmp_path), progress=False)
    assert cli_main(["index", str(tmp_path), "--quiet"]) == 1
    (tmp_path / "a-002.tar").unlink()
    again = index_tars(str(tmp_path), overwrite=True, progress=False)
    assert again["num_shards"] == 2 and again["num_samples"] == first["num_samples"] - 1
    _check(str(tmp_path), {k: v for k, v in tars.items() if k != "a-002.tar"})


def test_duplicate_keys_across_tars_name_both(tmp_path):
    _put(str(tmp_path), {"x.tar": _tarfile_bytes([("same.txt", b"1")]), "y.tar": _tarfile_bytes([("same.txt", b"2")])})
    with pytest.raises(SourceError, match=r"x\.tar.*y\.tar"):
        index_tars(str(tmp_path), progress=False)
    assert not (tmp_path / "dataset.json").exists()


def test_key_repeated_inside_one_tar_is_refused(tmp_path):
    _put(str(tmp_path), {"x.tar": _tarfile_bytes([("a.txt", b"1"), ("b.txt", b"2"), ("a.cls", b"3")])})
    with pytest.raises(SourceError, match=r"x\.tar: sample key 'a' appears twice"):
        index_tars(str(tmp_path), progress=False)
    assert not (tmp_path / "dataset.json").exists()


def test_fields_differing_only_in_case_are_refused(tmp_path):
    # The webdataset library lowercases field names and refuses such a sample.
    _put(str(tmp_path), {"x.tar": _tarfile_bytes([("0000.txt", b"0"), ("0001.jpg", b"lower"),
                                                  ("0001.JPG", b"UPPER")])})
    with pytest.raises(SourceError) as err:
        index_tars(str(tmp_path), progress=False)
    text = str(err.value)
    assert "x.tar" in text and "'0001'" in text and "'JPG'" in text and "'jpg'" in text
    assert not (tmp_path / "dataset.json").exists()
    assert cli_main(["index", str(tmp_path), "--quiet"]) == 1


def test_keys_whose_hashes_collide_are_told_apart_by_reading_them_back(tmp_path, monkeypatch):
    # The ledger keeps 64-bit key hashes, not keys: equal hashes are only suspects.
    from shardkit.packing import key_ledger as keyledger

    monkeypatch.setattr(keyledger, "key_hash", lambda key: 7)  # every key collides
    tars = _tars()
    _put(str(tmp_path / "ok"), tars)
    info = index_tars(str(tmp_path / "ok"), progress=False)
    assert info["num_samples"] == 12 + 3 + 1
    _check(str(tmp_path / "ok"), tars)
    _put(str(tmp_path / "dup"), {**tars, "z.tar": _tarfile_bytes([("./plain.bin", b"again")])})
    with pytest.raises(SourceError, match=r"duplicate sample key './plain': in a-001\.tar and z\.tar"):
        index_tars(str(tmp_path / "dup"), progress=False)


def test_no_tars(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(SourceError, match="no .tar files"):
        index_tars(str(tmp_path), progress=False)


def test_files_of_the_user_under_manifest_are_refused_not_deleted(tmp_path):
    """``shardkit index DIR`` used to delete DIR/manifest/ as a whole before writing its own
    manifest there, a user's notes included. Without --overwrite it now refuses, naming one;
    --overwrite replaces manifest/ (documented so), and a failed index removes only its own files."""
    tars = _tars()
    _put(str(tmp_path), tars)
    notes = tmp_path / "manifest" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    with pytest.raises(DatasetExistsError) as err:
        index_tars(str(tmp_path), progress=False)
    assert "manifest/notes.txt" in str(err.value) and "--overwrite" in str(err.value)
    assert cli_main(["index", str(tmp_path), "--quiet"]) == 1
    assert notes.read_text() == "mine" and not (tmp_path / "dataset.json").exists()
    index_tars(str(tmp_path), overwrite=True, progress=False)
    assert not notes.exists()
    _check(str(tmp_path), tars)


def test_failed_index_removes_only_what_it_wrote(tmp_path, monkeypatch):
    from shardkit.packing import index

    monkeypatch.setattr(index, "FRAGMENT_ROWS", 7)  # a fragment is written before the failure
    tars = _tars()
    _put(str(tmp_path), {**tars, "z.tar": _tarfile_bytes([("./plain.bin", b"again")])})
    with pytest.raises(SourceError, match="duplicate sample key './plain'"):
        index_tars(str(tmp_path), progress=False)
    assert not (tmp_path / "manifest").exists() and not (tmp_path / "dataset.json").exists()


@pytest.mark.parametrize("cut", ["no_end_blocks", "no_padding", "mid_data"])
def test_tar_cut_after_its_last_member(tmp_path, cut):
    """A tar cut right after its last member (no end-of-archive blocks; some writers stop
    there) still reads in tarfile and webdataset: the last sample's xxh3-64 must cover its
    data, not only its header. Cut inside the data, the member is refused as truncated."""
    import xxhash

    full = _tarfile_bytes([("0000.txt", b"payload 0"), ("0001.txt", b"payload 1" * 100), ("0002.txt", b"payload 2")],
                          fmt=tarfile.USTAR_FORMAT)
    last_data = 512 + 512 + 512 + 1024 + 512  # headers and bodies of the first two, then the last header
    end = {"no_end_blocks": last_data + 512, "no_padding": last_data + 9, "mid_data": last_data + 5}[cut]
    data = full[:end]
    _put(str(tmp_path), {"x.tar": data})
    if cut == "mid_data":
        with pytest.raises(UnsafeTarError, match=r"x\.tar: member '0002\.txt' size 9 beyond end of file"):
            index_tars(str(tmp_path), progress=False)
        return
    index_tars(str(tmp_path), progress=False)
    ds = shardkit.open_dataset(str(tmp_path))
    rows = ds.samples.to_pylist()
    assert [r["key"] for r in rows] == ["0000", "0001", "0002"]
    assert rows[-1]["offset"] + rows[-1]["size"] == len(data)  # padding included, up to the end of the file
    for r in rows:
        assert r["checksum"] == xxhash.xxh3_64_intdigest(data[r["offset"]:r["offset"] + r["size"]])
    ds.verify(deep=True)
    assert bytes(shardkit.ShardDataset(str(tmp_path))[2]["txt"]) == b"payload 2"
    assert [bytes(s["txt"]) for s in shardkit.StreamingDataset(str(tmp_path))][-1] == b"payload 2"


def test_keys_are_the_ones_webdataset_yields(tmp_path):
    """index keeps the tars as they are, so its keys must be webdataset's: GNU ``tar -cf x.tar .``
    names members ``./0001.jpg`` (key ``./0001``), and ``./0001.jpg`` then ``0001.cls`` are two
    samples to webdataset, so two to shardkit too."""
    import shutil
    import subprocess

    if shutil.which("tar") is None:
        pytest.skip("no tar command")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name, data in [("0001.jpg", b"a"), ("0001.cls", b"1"), ("0002.jpg", b"b"), ("sub/0003.jpg", b"c")]:
        (src / name).write_bytes(data)
    (tmp_path / "gnu").mkdir()
    subprocess.run(["tar", "--sort=name", "-cf", str(tmp_path / "gnu" / "x.tar"), "-C", str(src), "."], check=True)
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "x.tar").write_bytes(
        _tarfile_bytes([("./0001.jpg", b"a"), ("0001.cls", b"1"), ("./0002.jpg", b"b")], fmt=tarfile.USTAR_FORMAT))
    for case in ("gnu", "mixed"):
        root = str(tmp_path / case)
        index_tars(root, progress=False)
        want = _webdataset(f"{root}/x.tar")
        assert _readers(root) == want
        assert shardkit.open_dataset(root).samples.column("key").to_pylist() == [k for k, _ in want]
    assert [k for k, _ in _webdataset(str(tmp_path / "gnu" / "x.tar"))] == ["./0001", "./0002", "./sub/0003"]
    assert [k for k, _ in _webdataset(str(tmp_path / "mixed" / "x.tar"))] == ["./0001", "0001", "./0002"]


def test_members_webdataset_skips_or_reads_are_indexed_as_it_reads_them(tmp_path, monkeypatch):
    """A ``README``, ``__meta__`` or macOS ``._x.jpg`` member, or a field with ``~``, ``+`` or a
    space, used to refuse the whole collection. Now index reads what webdataset reads: skipped
    members between a sample's members lie inside its byte range but in none of its fields,
    and the sample's checksum covers them; a big one is not buffered (MAX_GAP stays small)."""
    import xxhash

    from shardkit.packing import index_scan as index

    monkeypatch.setattr(index, "MAX_GAP", 4096)
    members = [("__meta__", b"m"), ("README", b"read me"), ("0001.jpg", b"J1"), ("._0001.jpg", b"apple" * 3000),
               ("0001.cls", b"1"), ("0001.jpg~", b"backup"), ("0002.depth+16.png", b"D2"), ("0002.a b", b"space"),
               ("._0002.png", b"junk"), ("0003.JPG", b"J3"), ("__meta__/x.jpg", b"m2")]
    data = _tarfile_bytes(members)
    _put(str(tmp_path), {"x.tar": data})
    info = index_tars(str(tmp_path), progress=False)
    assert info["index"]["skipped_members"] == 5
    want = _webdataset(str(tmp_path / "x.tar"))
    assert [k for k, _ in want] == ["0001", "0002", "0003"]
    assert _readers(str(tmp_path), tmp_path / "cache") == want
    ds = shardkit.open_dataset(str(tmp_path))
    ds.verify(deep=True)
    assert set(ds.fields) == {"jpg", "cls", "jpg~", "depth+16.png", "a b"}
    for row in ds.samples.to_pylist():
        assert row["checksum"] == xxhash.xxh3_64_intdigest(data[row["offset"]:row["offset"] + row["size"]])
    first = ds.samples.to_pylist()[0]
    assert b"apple" * 3000 in data[first["offset"]:first["offset"] + first["size"]]  # spanned, not a field


@pytest.mark.s3
def test_a_tar_whose_etag_cannot_confirm_its_bytes_is_read_again_and_two_equal_reads_are_trusted(
        s3_bucket: str, s3_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    # Uploaded in 6 MiB parts, a part size no uploader's default has: the 5 MiB candidate fits
    # its 3 parts, so the ETag check says "no match" for good bytes. The index must read the
    # tar again and accept two reads that agree: neither refuse a good tar nor loop.
    # (Bytes flipped in transit: tests/faults/test_matrix.py, cell flip-index.)
    from shardkit.storage.etag import EtagCheck
    from shardkit.storage.store import Store

    mib = 2**20
    data = _tarfile_bytes([(f"s{i:02d}.bin", bytes([i]) * mib) for i in range(13)], fmt=tarfile.USTAR_FORMAT)
    url = f"{s3_bucket}/odd-parts"
    opts = s3_server.storage_options()
    store = Store(url, opts)
    client = store.boto3_client()
    bucket, prefix = store.bucket_key("a.tar")
    up = client.create_multipart_upload(Bucket=bucket, Key=prefix)
    parts = []
    for n, lo in enumerate(range(0, len(data), 6 * mib), start=1):
        r = client.upload_part(Bucket=bucket, Key=prefix, UploadId=up["UploadId"], PartNumber=n,
                               Body=data[lo:lo + 6 * mib])
        parts.append({"PartNumber": n, "ETag": r["ETag"]})
    client.complete_multipart_upload(Bucket=bucket, Key=prefix, UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": parts})
    info = store.info("a.tar")
    assert EtagCheck(info["ETag"], info["size"]).checkable
    with caplog.at_level("WARNING", logger="shardkit.storage.etag"):
        index_tars(url, storage_options=opts, progress=False)
    assert sum("do not match its ETag" in r.getMessage() for r in caplog.records) == 1
    _check(url, {"a.tar": data}, opts)
