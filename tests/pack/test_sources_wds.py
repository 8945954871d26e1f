"""tarscan (header walk, grouping, hostile tars) and WdsTarSource."""

from __future__ import annotations

import io
import pickle
import tarfile

import fsspec
import pytest

import shardkit

from shardkit.errors import SourceError, SourceNotFoundError, UnsafeTarError
from shardkit.packing.sample import StreamedField, safe_key
from shardkit.packing.sources import resolve_source
from shardkit.packing.sources import wds as wdsmod
from shardkit.packing.sources.wds import WdsTarSource
from shardkit.format.tarscan import group_members, scan_tar, split_name

LONG = "deep/" + "x" * 120 + "/" + "sample_with_a_very_long_name_" * 4  # > 100 chars: pax/GNU


def tar_bytes(members, fmt=tarfile.PAX_FORMAT) -> bytes:
    """members: (name, bytes) for files, (name, None) for a directory, or a TarInfo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m)
                continue
            name, data = m
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


SAMPLES = [
    ("dir/", None),
    ("dir/a.b.jpg", b"J" * 1000),
    ("dir/a.cls", b"3"),
    ("dir/a.json", b'{"x": 1}'),
    ("c.txt", b""),  # empty member
    (LONG + ".jpg", b"L" * 513),
    (LONG + ".cls", b"7"),
    ("./dot.txt", b"dotted"),
]
EXPECTED = {
    "dir/a": {"b.jpg": b"J" * 1000, "cls": b"3", "json": b'{"x": 1}'},
    "c": {"txt": b""},
    LONG: {"jpg": b"L" * 513, "cls": b"7"},
    "dot": {"txt": b"dotted"},
}


def scan_bytes(data: bytes, name="t.tar"):
    return list(scan_tar(io.BytesIO(data), name=name, file_size=len(data)))


# -- tarscan ---------------------------------------------------------------------------------

def test_split_name():
    assert split_name("dir/a.b.jpg") == ("dir/a", "b.jpg")
    assert split_name("a.cls") == ("a", "cls")
    assert split_name("./x/y.z") == ("x/y", "z")
    assert split_name("noext") == ("noext", "")


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_scan_offsets_and_groups(fmt):
    data = tar_bytes(SAMPLES, fmt)
    members = scan_bytes(data)
    files = [(n, d) for n, d in SAMPLES if d is not None]
    assert [m.name for m in members] == [n for n, _ in files]  # directory skipped
    for m, (_, content) in zip(members, files):
        assert data[m.offset_data : m.offset_data + m.size] == content
        assert m.end % 512 == 0 and m.offset_header % 512 == 0
        # [offset_header, end) is a tar stream of that member alone (extension headers included)
        with tarfile.open(fileobj=io.BytesIO(data[m.offset_header : m.end])) as tf:
            assert tf.getnames() == [m.name]
    long_jpg = members[4]
    assert long_jpg.offset_data - long_jpg.offset_header > 512  # pax or GNU 'L' header in range
    groups = [(k, [m.name for m in ms]) for k, ms in group_members(members)]
    assert [k for k, _ in groups] == ["dir/a", "c", LONG, "dot"]


def test_scan_pax_size_and_header_only_reads():
    data = tar_bytes([("a.bin", b"z" * 5000), ("b.bin", b"y" * 10)])

    class Counting(io.BytesIO):
        read_bytes = 0

        def read(self, n=-1):
            out = super().read(n)
            Counting.read_bytes += len(out)
            return out

    members = list(scan_tar(Counting(data), name="t", file_size=len(data)))
    assert [m.size for m in members] == [5000, 10]
    assert Counting.read_bytes <= 512 * 3  # two headers and the end marker, no data


# -- hostile tars ----------------------------------------------------------------------------

def _info(name, type_=tarfile.REGTYPE, **kw):
    info = tarfile.TarInfo(name)
    info.type = type_
    for k, v in kw.items():
        setattr(info, k, v)
    return info


@pytest.mark.parametrize(
    "member, match",
    [
        (("../evil.txt", b"x"), r"'\.\./evil\.txt'.*'\.\.'"),
        (("ok/../../evil.txt", b"x"), r"'ok/\.\./\.\./evil\.txt.*'\.\.'"),
        (("/abs.txt", b"x"), r"'/abs\.txt'.*absolute"),
        (_info("link.txt", tarfile.SYMTYPE, linkname="/etc/passwd"), r"'link\.txt' is a symlink"),
        (_info("hard.txt", tarfile.LNKTYPE, linkname="a.txt"), r"'hard\.txt' is a hardlink"),
        (_info("pipe.txt", tarfile.FIFOTYPE), r"'pipe\.txt' is a fifo"),
        (_info("tty.dev", tarfile.CHRTYPE, devmajor=4, devminor=1), r"'tty\.dev' is a character device"),
        (_info("sda.dev", tarfile.BLKTYPE, devmajor=8), r"'sda\.dev' is a block device"),
        ((LONG + "/../up.txt", b"x"), r"'deep/.*/up\.txt.*'\.\.'"),  # traversal hidden in a pax name
    ],
)
def test_hostile_members_refused(tmp_path, member, match):
    data = tar_bytes([("fine.txt", b"ok"), member])
    with pytest.raises(UnsafeTarError, match="evil.tar: member " + match):
        scan_bytes(data, name="evil.tar")
    path = tmp_path / "evil.tar"
    path.write_bytes(data)
    with pytest.raises(UnsafeTarError, match=match):
        WdsTarSource(path).list_items()
    with pytest.raises(ValueError):  # UnsafeTarError is a ValueError
        WdsTarSource(path).list_items()


@pytest.mark.parametrize("type_, match", [
    (tarfile.SYMTYPE, "is a symlink"),
    (tarfile.LNKTYPE, "is a hardlink"),
    (tarfile.REGTYPE, "has a GNU long link target"),  # a link target on a "file": refused too
])
def test_gnu_long_link_target_names_the_real_member(tmp_path, type_, match):
    # GNU tar puts a target over 100 bytes in a ././@LongLink record before the member: the
    # error named that record instead of the member.
    member = _info("0002.jpg", type_, linkname="/" + "z" * 150)
    data = tar_bytes([("0001.jpg", b"abc"), member], tarfile.GNU_FORMAT)
    assert b"././@LongLink" in data
    with pytest.raises(UnsafeTarError, match=r"evil\.tar: member '0002\.jpg' " + match) as err:
        scan_bytes(data, name="evil.tar")
    assert "LongLink" not in str(err.value)
    path = tmp_path / "evil.tar"
    path.write_bytes(data)
    with pytest.raises(UnsafeTarError, match=r"'0002\.jpg' " + match):
        WdsTarSource(path).list_items()


def test_gnu_long_names_and_long_link_headers_of_fine_members_still_scan():
    data = tar_bytes([(LONG + ".txt", b"long"), ("b.txt", b"b")], tarfile.GNU_FORMAT)
    assert [m.name for m in scan_bytes(data)] == [LONG + ".txt", "b.txt"]


def test_nul_in_pax_name_refused():
    info = _info("safe.txt", size=0)
    info.pax_headers = {"path": "bad\x00name.txt"}
    data = tar_bytes([info])
    with pytest.raises(UnsafeTarError, match="NUL"):
        scan_bytes(data)


def test_size_beyond_eof(tmp_path):
    data = tar_bytes([("a.txt", b"a"), ("big.bin", b"B" * 4096)])
    cut = data[: 512 * 3 + 1000]  # header a, data a, header big, part of big's data
    with pytest.raises(UnsafeTarError, match=r"member 'big\.bin' size 4096 beyond end of file"):
        scan_bytes(cut)


def test_truncated_header():
    data = tar_bytes([("a.txt", b"a"), ("b.txt", b"b")])
    cut = data[: 512 * 2 + 100]  # second header cut short
    with pytest.raises(UnsafeTarError, match="truncated tar header at offset 1024"):
        scan_bytes(cut)


def test_corrupt_header_checksum():
    data = bytearray(tar_bytes([("a.txt", b"a")]))
    data[10] ^= 0xFF
    with pytest.raises(UnsafeTarError, match="bad tar header at offset 0"):
        scan_bytes(bytes(data))


def test_extended_header_without_member():
    data = tar_bytes([(LONG + ".jpg", b"x")])
    members = scan_bytes(data)
    cut = data[: members[0].offset_data - 512] + b"\0" * 1024  # pax header, then end marker
    with pytest.raises(UnsafeTarError, match="no member after it"):
        scan_bytes(cut)


# -- WdsTarSource ----------------------------------------------------------------------------

def _check_roundtrip(src, expected_by_key):
    items = src.list_items()
    src = pickle.loads(pickle.dumps(src))
    got = {}
    for it in items:
        s = src.load(it)
        assert s.key == it.key == safe_key(s.meta["orig_key"])
        got[s.meta["orig_key"]] = {
            k: (b"".join(v.chunks()) if isinstance(v, StreamedField) else v) for k, v in s.fields.items()
        }
    assert got == expected_by_key
    return items


def test_local_roundtrip(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s-000.tar").write_bytes(tar_bytes(SAMPLES))
    (tmp_path / "shards" / "s-001.tar").write_bytes(tar_bytes([("z9.png", b"png"), ("z9.cls", b"1")], tarfile.GNU_FORMAT))
    (tmp_path / "shards" / "readme.md").write_text("not a tar")
    src = WdsTarSource(tmp_path / "shards")
    items = _check_roundtrip(src, {**EXPECTED, "z9": {"png": b"png", "cls": b"1"}})
    assert items[0].ref.startswith(str(tmp_path / "shards" / "s-000.tar") + "#512:")  # after "dir/"
    assert src.load(items[0]).meta["source"] == str(tmp_path / "shards" / "s-000.tar")
    assert items[-1].ref.split("/")[-1].startswith("s-001.tar#")
    assert all(it.nbytes > 0 and it.nbytes % 512 == 0 for it in items)


def test_works_with_webdataset_reader(tmp_path):
    wds = pytest.importorskip("webdataset")
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes([m for m in SAMPLES if m[0] != "./dot.txt"]))
    ours = [safe_key(k) for k, _ in group_members(scan_bytes(path.read_bytes()))]
    theirs = [safe_key(s["__key__"]) for s in wds.WebDataset(str(path), shardshuffle=False)]
    assert ours == theirs


def test_memory_fs_glob_and_dir():
    fs = fsspec.filesystem("memory")
    fs.pipe("/wdstest/a/s-000.tar", tar_bytes(SAMPLES))
    fs.pipe("/wdstest/a/s-001.tar", tar_bytes([("q.txt", b"q")]))
    try:
        for url in ("memory://wdstest/a/*.tar", "memory://wdstest/a", ["memory://wdstest/a/s-000.tar", "memory://wdstest/a/s-001.tar"]):
            src = WdsTarSource(url)
            items = _check_roundtrip(src, {**EXPECTED, "q": {"txt": b"q"}})
            assert items[0].ref.startswith("memory://") and "/wdstest/a/s-000.tar#512:" in items[0].ref
    finally:
        fs.rm("/wdstest", recursive=True)


def test_brace_urls_as_webdataset_writes_them(tmp_path):
    for i, members in enumerate((SAMPLES, [("q.txt", b"q")], [("r.txt", b"r")])):
        (tmp_path / f"part-{i:03d}.tar").write_bytes(tar_bytes(members))
    url = str(tmp_path / "part-{000..001}.tar")  # part-002 left out by the range
    src = resolve_source(url)
    assert isinstance(src, WdsTarSource) and [u for u, _ in src.tars()] == [
        str(tmp_path / "part-000.tar"), str(tmp_path / "part-001.tar")]
    _check_roundtrip(src, {**EXPECTED, "q": {"txt": b"q"}})
    info = shardkit.pack(url, str(tmp_path / "ds"), progress=False)
    assert info["num_samples"] == len(EXPECTED) + 1
    with pytest.raises(SourceNotFoundError, match="part-006.tar"):  # the first missing one
        WdsTarSource(str(tmp_path / "part-{006..007}.tar")).tars()


def test_large_samples_stream(tmp_path, monkeypatch):
    monkeypatch.setattr(wdsmod, "INLINE_LIMIT", 1024)
    monkeypatch.setattr(wdsmod, "CHUNK_BYTES", 700)
    big = bytes(range(256)) * 20
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes([("k.bin", big), ("k.cls", b"5"), (LONG + ".bin", big)]))
    src = WdsTarSource(str(path))
    items = src.list_items()
    s = src.load(items[0])
    assert isinstance(s.fields["bin"], StreamedField) and s.fields["cls"] == b"5"
    parts = list(s.fields["bin"].chunks())
    assert max(map(len, parts)) <= 700 and b"".join(parts) == big
    s = src.load(items[1])
    assert b"".join(s.fields["bin"].chunks()) == big and s.meta["orig_key"] == LONG


def test_duplicate_keys_across_tars(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes([("000.txt", b"1")]))
    (tmp_path / "b.tar").write_bytes(tar_bytes([("000.txt", b"2")]))
    with pytest.raises(SourceError, match=r"b\.tar: sample key '000'"):
        WdsTarSource(tmp_path).list_items()


def test_member_without_field(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes([("README", b"hi")]))
    with pytest.raises(SourceError, match=r"a\.tar: member 'README' has no extension"):
        WdsTarSource(tmp_path).list_items()


def test_repeated_field_in_sample(tmp_path):
    (tmp_path / "a.tar").write_bytes(tar_bytes([("k.txt", b"1"), ("k.txt", b"2")]))
    with pytest.raises(SourceError, match="repeats field 'txt'"):
        WdsTarSource(tmp_path).list_items()


def test_fields_differing_only_in_case_are_refused_or_skipped(tmp_path):
    # webdataset lowercases field names: 0001.jpg and 0001.JPG make a sample it refuses
    # ("duplicate file name in tar file"), so the shard would not be a WebDataset shard.
    wds = pytest.importorskip("webdataset")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.tar").write_bytes(tar_bytes([("0001.jpg", b"lower"), ("0001.JPG", b"UPPER"), ("0002.jpg", b"ok"),
                                           ("0003.Txt", b"t"), ("0003.TXT", b"T")], tarfile.USTAR_FORMAT))
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(src), str(tmp_path / "out"), progress=False)
    text = str(err.value)
    assert "a.tar" in text and "'0001'" in text and "'JPG'" in text and "'jpg'" in text and "\n" not in text
    assert not (tmp_path / "out" / "dataset.json").exists()
    info = shardkit.pack(str(src), str(tmp_path / "skip"), on_error="skip", progress=False)
    assert info["num_samples"] == 1 and [s["key"] for s in info["skipped"]] == ["0001", "0003"]
    assert "'JPG' and 'jpg' differ only in case" in info["skipped"][0]["reason"]
    shard = tmp_path / "skip" / "shards" / "shard-000000.tar"
    assert [s["__key__"] for s in wds.WebDataset(str(shard), shardshuffle=False, empty_check=False)] == ["0002"]



def test_upper_case_fields_of_tars_are_lowercased_as_webdataset_does(tmp_path):
    # 0001.JPG is field "jpg" to the webdataset library; shardkit's readers (pack or index)
    # must call it the same, as they already do for folder sources.
    wds = pytest.importorskip("webdataset")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.tar").write_bytes(tar_bytes([("0001.JPG", b"jpeg"), ("0001.Cls", b"3")], tarfile.USTAR_FORMAT))
    shardkit.pack(str(src), str(tmp_path / "out"), progress=False)
    shardkit.index_tars(str(src), progress=False)
    for root in (tmp_path / "out", src):
        sample, = list(shardkit.StreamingDataset(str(root), decode=None))
        assert {k: bytes(v) for k, v in sample.items() if not k.startswith("__")} == {"jpg": b"jpeg", "cls": b"3"}
    shard = tmp_path / "out" / "shards" / "shard-000000.tar"
    got, = list(wds.WebDataset(str(shard), shardshuffle=False, empty_check=False))
    assert {k: v for k, v in got.items() if not k.startswith("__")} == {"jpg": b"jpeg", "cls": b"3"}

def test_iterable_fields_differing_only_in_case_are_refused(tmp_path):
    items = [{"__key__": "a", "txt": "1"}, {"__key__": "b", "jpg": b"x", "JPG": b"y"}]
    with pytest.raises(SourceError) as err:
        shardkit.pack(iter(items), str(tmp_path / "out"), progress=False)
    text = str(err.value)
    assert "'b'" in text and "item 1" in text and "'JPG'" in text and "'jpg'" in text
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_writer_refuses_fields_differing_only_in_case(tmp_path):
    from shardkit.packing.sample import PackSample
    from shardkit.storage.store import Store
    from shardkit.packing.writer import ShardWriter

    with ShardWriter(Store(str(tmp_path / "ds")), shard_bytes=10**6) as w:
        with pytest.raises(SourceError, match=r"sample 'k': fields 'Cls' and 'cls' differ only in case"):
            w.write(PackSample("k", {"cls": b"1", "Cls": b"2"}))
        w.write(PackSample("k2", {"cls": b"1"}))


def test_tar_changed_after_listing(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(tar_bytes([("k.txt", b"1"), ("m.txt", b"2")]))
    src = WdsTarSource(path)
    items = src.list_items()
    path.write_bytes(tar_bytes([("other.txt", b"1"), ("m.txt", b"2")]))
    with pytest.raises(SourceError, match="did the tar change"):
        src.load(items[0])


def test_missing(tmp_path):
    with pytest.raises(SourceNotFoundError, match="nope.tar"):
        WdsTarSource(tmp_path / "nope.tar").list_items()
    with pytest.raises(SourceNotFoundError, match="memory://nothing-here"):
        WdsTarSource("memory://nothing-here/*.tar").list_items()


def test_secrets_not_in_repr_or_describe():
    src = WdsTarSource("s3://bucket/x.tar", storage_options={"secret": "hunter2", "key": "AKIA"})
    assert "hunter2" not in repr(src) and "hunter2" not in str(src.describe())


@pytest.mark.parametrize("other", ["README.md", "c.tar.gz", "sub/notes.txt"])
def test_folder_of_tars_and_other_files_is_refused(tmp_path, other):
    """A folder of WebDataset tars plus one other file used to be packed as a folder of
    ``<key>.<field>`` files: each tar one opaque sample (field ``tar``), exit 0."""
    from shardkit.cli import main as cli_main

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.tar").write_bytes(tar_bytes(SAMPLES))
    (src / "b.tar").write_bytes(tar_bytes([("q.txt", b"q")]))
    (src / ".hidden").write_text("ignored, as everywhere in folder sources")
    assert isinstance(resolve_source(str(src)), WdsTarSource)
    (src / other).parent.mkdir(exist_ok=True)
    (src / other).write_bytes(b"not a plain tar")
    with pytest.raises(SourceError) as err:
        resolve_source(str(src))
    msg = str(err.value)
    assert f"source {src} holds 2 .tar files and 1 other file ({other}" in msg and "\n" not in msg
    assert "only .tar files" in msg and "move the other files out" in msg
    assert ("compressed tars are not supported" in msg) == other.endswith(".tar.gz")
    assert cli_main(["pack", str(src), str(tmp_path / "ds"), "--quiet"]) == 1
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("name", ["c.tar.gz", "c.tgz", "c.tar.zst"])
def test_a_compressed_tar_is_refused_saying_to_decompress_it(tmp_path, name):
    """A compressed tar given as the source says what to do, as one inside a folder of tars does,
    rather than "unsupported file type .gz"."""
    (tmp_path / name).write_bytes(b"not a plain tar")
    with pytest.raises(SourceError) as err:
        resolve_source(str(tmp_path / name))
    msg = str(err.value)
    assert msg.startswith(f"source {tmp_path / name}: a compressed tar") and "\n" not in msg
    assert "decompress it to .tar" in msg


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_local_glob_of_tars(tmp_path, scheme, capsys):
    """README lists a glob of tars as a source; a local one was refused as "does not exist"
    (globs worked on s3:// only). Matches are read sorted; an empty match or a glob that
    matches other files is one line naming the pattern."""
    from shardkit.cli import main as cli_main

    (tmp_path / "tars").mkdir()
    for i, members in ((1, [("q.txt", b"q")]), (0, SAMPLES), (2, [("r.txt", b"r")])):
        (tmp_path / "tars" / f"shard-{i}.tar").write_bytes(tar_bytes(members))
    (tmp_path / "tars" / "notes.txt").write_text("not matched by the glob")
    pattern = f"{scheme}{tmp_path}/tars/shard-*.tar"
    src = resolve_source(pattern)
    assert isinstance(src, WdsTarSource)
    assert [u for u, _ in src.tars()] == [str(tmp_path / "tars" / f"shard-{i}.tar") for i in range(3)]
    _check_roundtrip(src, {**EXPECTED, "q": {"txt": b"q"}, "r": {"txt": b"r"}})
    assert cli_main(["pack", pattern, str(tmp_path / f"ds{len(scheme)}"), "--quiet"]) == 0
    assert shardkit.open_dataset(str(tmp_path / f"ds{len(scheme)}")).num_samples == len(EXPECTED) + 2

    empty = f"{scheme}{tmp_path}/tars/nothing-*.tar"
    with pytest.raises(SourceNotFoundError, match=rf"source {tmp_path}/tars/nothing-\*\.tar: no files match"):
        resolve_source(empty)
    capsys.readouterr()
    assert cli_main(["pack", empty, str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing-*.tar: no files match this pattern" in err
    with pytest.raises(SourceError, match=r"tars/\*: a glob is read as WebDataset tars, but it matches .*notes\.txt"):
        resolve_source(f"{scheme}{tmp_path}/tars/*")


def test_indexed_folder_packs_as_tars(tmp_path):
    """After ``shardkit index DIR``, ``shardkit pack DIR DEST`` refused DIR as a folder mixing
    .tar files with other files: index's own dataset.json and manifest/. They are not input."""
    from shardkit.cli import main as cli_main

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.tar").write_bytes(tar_bytes(SAMPLES))
    (src / "sub" / "b.tar").write_bytes(tar_bytes([("q.txt", b"q")]))
    assert cli_main(["index", str(src), "--quiet"]) == 0
    assert (src / "dataset.json").is_file() and any((src / "manifest").iterdir())
    (src / "_pack").mkdir()
    (src / "_pack" / "left.tar").write_bytes(tar_bytes([("stale.txt", b"s")]))  # an unfinished pack's, not input
    src_obj = resolve_source(str(src))
    assert isinstance(src_obj, WdsTarSource)
    assert [u for u, _ in src_obj.tars()] == [str(src / "a.tar"), str(src / "sub" / "b.tar")]
    assert cli_main(["pack", str(src), str(tmp_path / "ds"), "--quiet"]) == 0
    ds = shardkit.open_dataset(str(tmp_path / "ds"))
    assert ds.num_samples == len(EXPECTED) + 1 and set(ds.fields) == {"b.jpg", "cls", "json", "txt", "jpg"}
    # Without dataset.json, manifest/ is someone's folder like any other: still refused as mixed.
    (src / "dataset.json").unlink()
    with pytest.raises(SourceError, match="other file"):
        resolve_source(str(src))
