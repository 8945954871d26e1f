"""Bad input: each case fails with one clear line naming the object at fault (API and CLI)."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.errors import (ConfigError, DatasetExistsError, ShardkitError, SourceError, SourceNotFoundError, StorageError,
                             StoragePermissionError)

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH: run this checkout's shardkit whatever the cwd.
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "shardkit.cli", *args], capture_output=True, text=True,
                          env=full, timeout=timeout, cwd=REPO)


def one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def check_message(exc: BaseException, *names: str) -> None:
    msg = str(exc)
    assert "\n" not in msg, msg
    for name in names:
        assert name in msg, (name, msg)


def folder(root: Path, n: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"s{i}.txt").write_bytes(f"sample {i}".encode() * 50)
    return root


def tiny_jpeg(seed: int = 0) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 6), (seed % 256, 80, 160)).save(buf, "JPEG")
    return buf.getvalue()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when we return: connections are refused


# --------------------------------------------------------------------------- sources


def test_missing_source(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(SourceNotFoundError) as err:
        shardkit.pack(str(missing), str(tmp_path / "out"), progress=False)
    assert isinstance(err.value, FileNotFoundError)
    check_message(err.value, str(missing))
    r = cli("pack", str(missing), str(tmp_path / "out2"))
    assert r.returncode != 0 and str(missing) in one_line(r.stderr)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_empty_source_dir(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / ".hidden").write_text("x")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(empty), str(tmp_path / "out"), progress=False)
    check_message(err.value, str(empty))
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(empty), str(tmp_path / "out"), labels_from_dirs=True, progress=False)
    check_message(err.value, str(empty))
    r = cli("pack", str(empty), str(tmp_path / "out2"))
    assert r.returncode == 1 and str(empty) in one_line(r.stderr)


def make_unreadable(path: Path) -> str:
    """Make ``path`` unreadable; returns how.

    chmod 000 blocks reads only for non-root users. As root (containers, CI) nothing blocks
    a read of a regular file, so the file becomes a broken symlink instead: a name that is
    listed but whose data cannot be read, which is what a vanished or unreadable file looks
    like to the packer.
    """
    if os.geteuid() != 0:
        path.chmod(0)
        return "chmod"
    path.unlink()
    path.symlink_to(path.parent / "vanished-target")
    return "broken symlink"


@pytest.mark.parametrize("kind", ["folder", "imagefolder"])
def test_unreadable_file(tmp_path: Path, kind: str) -> None:
    if kind == "folder":
        src = folder(tmp_path / "src")
        bad = src / "s2.txt"
        kw: dict[str, Any] = {}
    else:
        src = tmp_path / "src"
        folder(src / "cls0")
        for i in range(3):  # real images: a fake one is refused at pack time for what it is
            (src / "cls0" / f"i{i}.jpg").write_bytes(tiny_jpeg(i))
        bad = src / "cls0" / "i1.jpg"
        kw = {"labels_from_dirs": True}
    how = make_unreadable(bad)
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(src), str(tmp_path / "out"), progress=False, **kw)
    check_message(err.value, str(bad))
    assert not (tmp_path / "out" / "dataset.json").exists()
    # on_error="skip": the rest is packed and the bad file is listed in dataset.json.
    info = shardkit.pack(str(src), str(tmp_path / "skip"), on_error="skip", progress=False, **kw)
    assert [s["ref"] for s in info["skipped"]] and str(bad.relative_to(src)) in info["skipped"][0]["ref"], how
    ds = shardkit.open_dataset(str(tmp_path / "skip"))
    assert ds.num_samples == info["num_samples"] >= 2 and ds.info["skipped"] == info["skipped"]
    assert ds.verify(deep=True)["ok"]
    if kind == "folder":
        r = cli("pack", str(src), str(tmp_path / "out2"))
        assert r.returncode == 1 and str(bad) in one_line(r.stderr)


def test_duplicate_keys_in_file_list(tmp_path: Path) -> None:
    src = folder(tmp_path / "files")
    lst = tmp_path / "list.csv"
    lst.write_text("path,key\nfiles/s0.txt,a\nfiles/s1.txt,b\nfiles/s2.txt,a\n")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(lst), str(tmp_path / "out"), progress=False)
    check_message(err.value, "'a'", str(lst), "s0.txt", "s2.txt")
    lst2 = tmp_path / "list2.csv"  # no key column: the same path twice is the same key twice
    lst2.write_text("path\nfiles/s0.txt\nfiles/s1.txt\nfiles/s0.txt\n")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(lst2), str(tmp_path / "out"), progress=False)
    check_message(err.value, "duplicate", str(lst2))
    assert src.exists() and not (tmp_path / "out").exists()
    r = cli("pack", str(lst), str(tmp_path / "out3"))
    assert r.returncode == 1 and "duplicate key 'a'" in one_line(r.stderr)
    assert "rename or leave out one of them" in one_line(r.stderr)  # and what to do


def test_folder_fields_differing_only_in_case_are_refused(tmp_path: Path) -> None:
    # x.JPG and x.jpg would both be field "jpg" of sample "x": one would silently replace the other.
    src = tmp_path / "src"
    src.mkdir()
    (src / "x.JPG").write_bytes(b"upper")
    (src / "x.jpg").write_bytes(b"lower")
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(src), str(tmp_path / "out"), progress=False)
    check_message(err.value, "x.JPG", "x.jpg")
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_folder_names_with_separator_characters_pack_whole(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d=1|2").mkdir(parents=True)
    want = {"d=1|2/a|b": {"jpg": tiny_jpeg(1), "txt": b"2"}, "c": {"bin": b"3"}}
    for key, fields in want.items():
        for field, data in fields.items():
            (src / f"{key}.{field}").write_bytes(data)
    shardkit.pack(str(src), str(tmp_path / "out"), progress=False)
    got = [{k: bytes(v) for k, v in s.items() if not k.startswith("__")}
           for s in shardkit.open_dataset(str(tmp_path / "out")).iter_samples()]
    assert sorted(got, key=repr) == sorted(want.values(), key=repr)


def test_on_error_skip_leaves_out_what_listing_cannot_use(tmp_path: Path) -> None:
    # A README among <key>.<field> files, a file list's row naming a missing file: an error
    # naming it by default; with on_error="skip", left out and listed under "skipped".
    src = folder(tmp_path / "src")
    (src / "README").write_text("about this data")
    with pytest.raises(SourceError, match="README"):
        shardkit.pack(str(src), str(tmp_path / "a"), progress=False)
    info = shardkit.pack(str(src), str(tmp_path / "b"), on_error="skip", progress=False)
    assert info["num_samples"] == 4 and [s["ref"] for s in info["skipped"]] == [str(src / "README")]
    assert "cannot group" in info["skipped"][0]["reason"]
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\n" + "".join(f"src/{p.name},1\n" for p in sorted(src.glob("*.txt")))
                       + "missing.bin,2\n")
    with pytest.raises(SourceError, match="missing.bin"):
        shardkit.pack(str(listing), str(tmp_path / "c"), progress=False)
    info = shardkit.pack(str(listing), str(tmp_path / "d"), on_error="skip", progress=False)
    n = len(list(src.glob("*.txt")))
    assert info["num_samples"] == n and len(info["skipped"]) == 1 and "missing.bin" in info["skipped"][0]["reason"]


def test_imagefolder_says_which_images_it_leaves_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from PIL import Image

    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    for name in ("cat/a.png", "cat/b.png", "loose.png"):
        Image.new("RGB", (4, 4)).save(src / name)
    with caplog.at_level("WARNING", logger="shardkit"):
        info = shardkit.pack(str(src), str(tmp_path / "ds"), labels_from_dirs=True, progress=False)
    assert info["num_samples"] == 2
    assert "1 image(s) directly under" in caplog.text and "loose.png" in caplog.text


def test_duplicate_keys_in_iterable(tmp_path: Path) -> None:
    items = [{"__key__": k, "txt": f"v{i}"} for i, k in enumerate(["a", "b", "c", "b"])]
    with pytest.raises(SourceError) as err:
        shardkit.pack(iter(items), str(tmp_path / "out"), shard_bytes=1000, progress=False)
    check_message(err.value, "'b'", "item 3")
    with pytest.raises(shardkit.errors.DatasetNotFoundError):
        shardkit.open_dataset(str(tmp_path / "out"))


def test_iterable_field_names_are_lowercased_as_webdataset_reads_them(tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    info = shardkit.pack([{"__key__": "0001", "JPG": b"x", "Cls": 1}], str(tmp_path / "ds"), progress=False)
    assert info["fields"] == ["cls", "jpg"]
    sample = shardkit.ShardDataset(str(tmp_path / "ds"))[0]
    assert {k: bytes(v) for k, v in sample.items() if not k.startswith("__")} == {"cls": b"1", "jpg": b"x"}
    got, = list(wds.WebDataset(str(tmp_path / "ds" / "shards" / "shard-000000.tar"), shardshuffle=False))
    assert sorted(k for k in got if not k.startswith("__")) == ["cls", "jpg"]


def test_iterable_bad_samples_are_skipped_and_listed(tmp_path: Path) -> None:
    items = [{"__key__": "a", "txt": "1"}, {"__key__": "b", "jpg": b"x", "JPG": b"y"}, {"__key__": "c", "txt": object()},
             "not a dict", {"__key__": "a", "txt": "again"}, {"__key__": "d", "TXT": "4"}]
    info = shardkit.pack(iter(items), str(tmp_path / "ds"), on_error="skip", progress=False)
    assert info["num_samples"] == 2 and info["fields"] == ["txt"]
    assert [(s["ref"], s["key"]) for s in info["skipped"]] == [("item 1", "b"), ("item 2", "c"), ("item 3", ""),
                                                               ("item 4", "a")]
    assert "'JPG' and 'jpg' differ only in case" in info["skipped"][0]["reason"]
    assert sorted(shardkit.open_dataset(str(tmp_path / "ds")).samples.column("key").to_pylist()) == ["a", "d"]


def test_iterable_numpy_scalars(tmp_path: Path) -> None:
    import numpy as np

    info = shardkit.pack([{"__key__": "a", "b": np.bool_(True), "i": np.int16(-3), "f": np.float32(0.5)}],
                         str(tmp_path / "ds"), progress=False)
    sample = shardkit.ShardDataset(str(tmp_path / "ds"))[0]
    assert info["fields"] == ["b", "f", "i"] and [bytes(sample[k]) for k in "bif"] == [b"1", b"-3", b"0.5"]
    with pytest.raises(SourceError) as err:  # said "unsupported type bool" for np.bool_, which is supported
        shardkit.pack([{"__key__": "a", "c": np.complex64(1)}], str(tmp_path / "ds2"), progress=False)
    check_message(err.value, "'a'", "'c'", "unsupported type numpy.complex64")


# --------------------------------------------------------------------------- destination


def test_destination_holding_a_dataset(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    dest = tmp_path / "ds"
    shardkit.pack(str(src), str(dest), progress=False)
    (src / "s9.txt").write_bytes(b"new sample")
    with pytest.raises(DatasetExistsError) as err:
        shardkit.pack(str(src), str(dest), progress=False)
    assert isinstance(err.value, FileExistsError)
    check_message(err.value, str(dest), "overwrite")
    with pytest.raises(DatasetExistsError):
        shardkit.pack(iter([{"__key__": "x", "txt": "y"}]), str(dest), progress=False)
    assert shardkit.open_dataset(str(dest)).num_samples == 4  # untouched
    r = cli("pack", str(src), str(dest))
    assert r.returncode == 1 and "--overwrite" in one_line(r.stderr)
    assert shardkit.pack(str(src), str(dest), overwrite=True, progress=False)["num_samples"] == 5
    assert shardkit.open_dataset(str(dest)).verify(deep=True)["ok"]
    (src / "s8.txt").write_bytes(b"another")
    r = cli("pack", str(src), str(dest), "--overwrite", "--quiet")
    assert r.returncode == 0, r.stderr
    ds = shardkit.open_dataset(str(dest))
    assert ds.num_samples == 6 and ds.verify(deep=True)["ok"]


# --------------------------------------------------------------------------- storage


def test_wrong_credentials_on_s3(s3_server: Any, s3_bucket: str, tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    wrong_secret = "WRONGsecret" + "9" * 29
    opts = s3_server.storage_options()
    opts["secret"] = wrong_secret
    t0 = time.monotonic()
    with pytest.raises(StoragePermissionError) as err:
        shardkit.pack(str(src), f"{s3_bucket}/ds", storage_options=opts, progress=False)
    assert time.monotonic() - t0 < 20
    assert isinstance(err.value, PermissionError)
    check_message(err.value, s3_bucket)
    for secret in (wrong_secret, s3_server.secret):
        assert secret not in str(err.value) and secret not in repr(err.value)

    # Reading with wrong keys is refused the same way (a good pack first, then bad keys).
    shardkit.pack(str(src), f"{s3_bucket}/ok", storage_options=s3_server.storage_options(), progress=False)
    with pytest.raises(StoragePermissionError) as err:
        shardkit.open_dataset(f"{s3_bucket}/ok", storage_options=opts)
    assert wrong_secret not in str(err.value)

    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": wrong_secret}
    for args in (("pack", str(src), f"{s3_bucket}/cli"), ("info", f"{s3_bucket}/ok")):
        r = cli(*args, env=env)
        assert r.returncode == 1, (args, r.stderr)
        line = one_line(r.stderr)
        assert "denied" in line or "credentials" in line, line
        for secret in (wrong_secret, s3_server.secret):
            assert secret not in r.stderr and secret not in r.stdout


def test_missing_credentials_say_where_to_set_them(s3_server: Any, s3_bucket: str, tmp_path: Path) -> None:
    """No key anywhere (no storage_options key, no AWS_* variables, no profile): the one line
    used to be botocore's 'Unable to locate credentials', which says nothing of where they go."""
    src = folder(tmp_path / "src")
    env = {k: v for k, v in s3_server.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    for args in (("pack", str(src), f"{s3_bucket}/ds"), ("info", f"{s3_bucket}/ds")):
        r = cli(*args, env=env)
        assert r.returncode == 1, (args, r.stderr)
        line = one_line(r.stderr)
        assert "no credentials for" in line and f"{s3_bucket}/ds" in line, line
        assert "AWS_ACCESS_KEY_ID" in line and "storage_options" in line, line
    so = {"client_kwargs": s3_server.storage_options()["client_kwargs"]}
    with pytest.raises(StoragePermissionError) as err:
        shardkit.open_dataset(f"{s3_bucket}/ds", storage_options=so)
    check_message(err.value, "no credentials for", s3_bucket, "AWS_SECRET_ACCESS_KEY")


def test_invalid_bucket_name_says_what_is_invalid(s3_server: Any, tmp_path: Path) -> None:
    """botocore refuses a bucket name before any request, in two lines: 'Parameter validation
    failed:' then what is invalid. The one line of the error used to stop at the first."""
    src = folder(tmp_path / "src")
    with pytest.raises(StorageError) as err:
        shardkit.pack(str(src), "s3://Bad_Bucket!/ds", storage_options=s3_server.storage_options(), progress=False)
    check_message(err.value, 'Invalid bucket name "Bad_Bucket!"')
    r = cli("pack", str(src), "s3://Bad_Bucket!/ds", env=s3_server.env())
    assert r.returncode == 1 and 'Invalid bucket name "Bad_Bucket!"' in one_line(r.stderr), r.stderr
    assert s3_server.secret not in r.stderr + r.stdout


@pytest.mark.parametrize("where", ["local", "s3"])
def test_shard_truncated_in_storage_is_named_not_blamed_on_the_network(request: pytest.FixtureRequest, where: str,
                                                                       tmp_path: Path) -> None:
    # A short body is retried as a dropped connection, unless the object itself ends early:
    # then the reader says so (IntegrityError naming the shard), not "cannot reach storage".
    import fsspec

    from shardkit.errors import IntegrityError

    if where == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        url, opts = f"{bucket}/ds", server.storage_options()
    else:
        url, opts = str(tmp_path / "ds"), {}
    samples = [{"__key__": f"k{i:03d}", "bin": bytes([i]) * 5000} for i in range(60)]
    shardkit.pack(samples, url, shard_bytes="100KB", storage_options=opts, progress=False)
    victim = shardkit.open_dataset(url, storage_options=opts).shard_list[1].path
    fs, root = fsspec.core.url_to_fs(url, **opts)
    data = fs.cat_file(f"{root}/{victim}")
    fs.pipe_file(f"{root}/{victim}", data[:len(data) // 2])
    for kw in ({"cache_dir": tmp_path / "c1", "batch_size": 8}, {"cache_dir": tmp_path / "c2"}, {"cache_dir": None}):
        stream = shardkit.StreamingDataset(url, storage_options=opts, **kw)  # type: ignore[arg-type]
        with pytest.raises(IntegrityError) as err:
            list(stream)
        check_message(err.value, victim)
        assert f"holds {len(data) // 2} bytes" in str(err.value) and "reach" not in str(err.value), kw


def test_decode_errors_name_the_sample_its_shard_and_field(tmp_path: Path) -> None:
    from shardkit.errors import DecodeError

    good = [{"__key__": f"ok{i}", "cls": str(i).encode(), "json": b'{"a": 1}'} for i in range(5)]
    for bad, field in (({"__key__": "bad", "cls": b"abc", "json": b"{}"}, "cls"),
                       ({"__key__": "bad", "cls": b"1", "json": b"{nope"}, "json"),
                       ({"__key__": "bad", "cls": b"1", "jpg": b"not an image"}, "jpg")):
        url = str(tmp_path / field)
        shardkit.pack([*good, bad], url, progress=False)
        shard = shardkit.open_dataset(url).shard_list[0].path
        with pytest.raises(DecodeError) as err:
            list(shardkit.StreamingDataset(url, decode="pil"))
        check_message(err.value, "'bad'", shard, repr(field))
        assert err.value.__cause__ is not None
    def strict(sample: dict[str, Any]) -> int:
        return int(bytes(sample["cls"]))
    loader = shardkit.StreamingDataLoader(shardkit.StreamingDataset(str(tmp_path / "cls"), decode=strict), num_workers=2)
    try:
        list(loader)
        message = ""
    except Exception as exc:  # noqa: BLE001 - torch re-raises the worker's error as its own type
        message = str(exc)
    gc.collect()  # the failed epoch's workers go with its iterator
    assert "'bad'" in message and "strict" in message  # also from a DataLoader worker


def test_decode_error_of_bytes_that_are_no_image_says_so(tmp_path: Path) -> None:
    from shardkit.errors import DecodeError

    url = str(tmp_path / "ds")  # an iterable is packed as given: its bytes are the caller's
    shardkit.pack([{"__key__": "bad", "jpg": b"not an image"}], url, progress=False)
    for decode in ("pil", shardkit.CenterCrop(16)):
        with pytest.raises(DecodeError) as err:
            list(shardkit.StreamingDataset(url, decode=decode))
        check_message(err.value, "'bad'", "'jpg'", "not a recognizable image")
        assert "BytesIO" not in str(err.value) and " at 0x" not in str(err.value)


@pytest.mark.parametrize("reader", ["stream", "random"])
def test_empty_cache_dir_is_refused_not_the_working_directory(tmp_path: Path, reader: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "ds")
    shardkit.pack([{"__key__": "a", "bin": b"1"}], url, progress=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    make = shardkit.StreamingDataset if reader == "stream" else shardkit.ShardDataset
    with pytest.raises(ConfigError, match="cache_dir"):
        make(url, cache_dir="")
    assert list((tmp_path / "cwd").iterdir()) == []


def test_unreachable_endpoint(tmp_path: Path) -> None:
    src = folder(tmp_path / "src")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    opts = {"key": "k", "secret": "s3cr3t-value-xyz", "client_kwargs": {"endpoint_url": endpoint}}
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        shardkit.pack(str(src), "s3://bucket/ds", storage_options=opts, progress=False)
    elapsed = time.monotonic() - t0
    assert elapsed < 20, f"took {elapsed:.1f}s"  # a hang guard, not a performance assertion
    check_message(err.value, endpoint)
    assert "s3cr3t-value-xyz" not in str(err.value)

    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s3cr3t-value-xyz"}
    t0 = time.monotonic()
    r = cli("info", "s3://bucket/ds", env=env, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 1 and endpoint in one_line(r.stderr)
    assert "s3cr3t-value-xyz" not in r.stderr


def test_unreachable_http_url_is_not_called_missing(tmp_path: Path) -> None:
    # fsspec's HTTPFileSystem.exists says False for a server it cannot reach: that read as
    # "dataset.json is missing". A refused connection is now said as such; a 404 still is missing.
    import functools
    import http.server
    import threading

    for scheme in ("http", "https"):
        url = f"{scheme}://127.0.0.1:{closed_port()}/ds"
        with pytest.raises(StorageError) as err:
            shardkit.open_dataset(url)
        assert not isinstance(err.value, shardkit.errors.DatasetNotFoundError)
        check_message(err.value, "cannot reach storage", url)
        r = cli("info", url)
        assert r.returncode == 1 and "cannot reach storage" in one_line(r.stderr) and url in r.stderr, r.stderr

    shardkit.pack(str(folder(tmp_path / "src")), str(tmp_path / "www" / "ds"), progress=False)
    (tmp_path / "www" / "empty").mkdir()
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(tmp_path / "www")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(shardkit.errors.DatasetNotFoundError) as missing:
            shardkit.open_dataset(f"{base}/empty")
        check_message(missing.value, "dataset.json is missing", f"{base}/empty")
        assert shardkit.open_dataset(f"{base}/ds").num_samples == 4
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_errors_are_shardkit_errors(tmp_path: Path) -> None:
    # Bad options are ConfigErrors naming the option, raised before anything is written.
    src = folder(tmp_path / "src")
    for kw, name in (({"shard_bytes": "12XB"}, "shard_bytes"), ({"engine": "spark"}, "engine"),
                     ({"on_error": "ignore"}, "on_error"), ({"shard_samples": 0}, "shard_samples")):
        with pytest.raises(ShardkitError) as err:
            shardkit.pack(str(src), str(tmp_path / "out"), progress=False, **kw)
        assert isinstance(err.value, ValueError)
        check_message(err.value, name)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz", "zstd"])
@pytest.mark.parametrize("payload", [1, 4000])  # a compressed file shorter, and longer, than one tar header
def test_compressed_file_named_tar_says_so(tmp_path: Path, kind: str, payload: int) -> None:
    """A .tar.gz renamed .tar said "truncated tar header at offset 0 (96 of 512 bytes)"."""
    import bz2
    import gzip
    import io
    import lzma
    import tarfile

    import pyarrow as pa

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("0001.bin")
        info.size = payload
        tf.addfile(info, io.BytesIO(os.urandom(payload)))
    raw = buf.getvalue()
    packed = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress,
              "zstd": lambda b: pa.compress(b, codec="zstd", asbytes=True)}[kind](raw)
    assert (len(packed) < 512) == (payload == 1)
    (tmp_path / "wds").mkdir()
    (tmp_path / "wds" / "x.tar").write_bytes(packed)
    want = f"x.tar: looks {kind}-compressed"
    line = one_line(cli("index", str(tmp_path / "wds")).stderr)
    assert want in line and "compressed tars are not read" in line
    with pytest.raises(ShardkitError, match=want):
        shardkit.pack(str(tmp_path / "wds" / "x.tar"), str(tmp_path / "ds"), progress=False)
