"""The CLI end to end: --json output, exit codes 0/1/2, corruption and missing-commit reports, no secrets.

Every command runs as a user runs it: ``python -m shardkit.cli ...`` in a subprocess, with the
standard AWS_* variables for S3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shardkit
from shardkit.errors import DatasetNotFoundError

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH: run this checkout's shardkit whatever the cwd.
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "shardkit.cli", *args], capture_output=True, text=True,
                          env=full, timeout=120, cwd=REPO)


def one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def make_source(root: Path, n: int = 12) -> Path:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"k{i:02d}.bin").write_bytes(bytes([i]) * (700 + 37 * i))
        (root / f"k{i:02d}.json").write_text(json.dumps({"i": i}))
    return root


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return make_source(tmp_path / "src")


# --------------------------------------------------------------------------- 8. json + exit codes


def test_pack_info_verify_json_local(source: Path, tmp_path: Path) -> None:
    dest = str(tmp_path / "ds")
    r = cli("pack", str(source), dest, "--shard-size", "4KB", "--json")
    assert r.returncode == 0, r.stderr
    packed = json.loads(r.stdout)
    assert packed["num_samples"] == 12 and packed["num_shards"] >= 3 and packed["fields"] == ["bin", "json"]
    r = cli("info", dest, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert {k: info[k] for k in ("num_samples", "num_shards", "total_bytes")} == \
        {k: packed[k] for k in ("num_samples", "num_shards", "total_bytes")}
    assert info == json.loads((tmp_path / "ds" / "dataset.json").read_text())
    r = cli("verify", dest, "--deep", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ok": True, "shards_checked": packed["num_shards"], "deep": True, "num_samples": 12}
    r = cli("info", dest)  # human output works too
    assert r.returncode == 0 and "12" in r.stdout


@pytest.mark.parametrize("args", [
    ("pack", "SRC", "DEST", "--bogus"),
    ("pack", "SRC", "DEST", "--shard-size", "12XB"),
    ("pack", "SRC", "DEST", "--shard-size", "-5MB"),  # argparse took -5MB for an option
    ("pack", "SRC", "DEST", "--shard-size=-5MB"),
    ("pack", "SRC", "DEST", "--engine", "spark"),
    ("pack", "SRC"),
    ("verify",),
    ("frobnicate", "x"),
    ("info", "foo://bar/baz"),  # a URL scheme no filesystem has is bad usage too
    ("verify", "foo://bar/baz"),
    ("index", "simplecache::foo://bar"),
    ("pack", "SRC", "foo://bar/baz"),
    ("pack", "foo://bar/a.tar", "DEST"),
])
def test_bad_usage_exits_2(args: tuple[str, ...], source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "ds"
    argv = [str(source) if a == "SRC" else str(dest) if a == "DEST" else a for a in args]
    r = cli(*argv)
    assert r.returncode == 2, (argv, r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    if "12XB" in args:
        assert "12XB" in one_line(r.stderr) and "shard" in r.stderr
    if any("-5MB" in a for a in args):
        assert one_line(r.stderr) == "shardkit: error: --shard-size: size must be positive, got '-5MB'"
    if any(a.startswith(("foo:", "simplecache:")) for a in args):
        assert "unknown URL scheme 'foo'" in one_line(r.stderr) and "foo://bar" in r.stderr
    assert not dest.exists()


@pytest.mark.parametrize("under", [False, True])
def test_destination_that_is_a_file_is_bad_usage(under: bool, source: Path, tmp_path: Path) -> None:
    # A raw "NotADirectoryError: [Errno 20] ..." with exit 1 before.
    afile = tmp_path / "afile"
    afile.write_text("mine")
    dest = afile / "ds" if under else afile
    r = cli("pack", str(source), str(dest), "--quiet")
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert line.startswith(f"shardkit: error: destination {dest} ") and "not a directory" in line, line
    assert "Errno" not in line and afile.read_text() == "mine"


@pytest.mark.parametrize("where", ["dest-in-source", "source-in-dest", "same", "via-symlink"])
def test_destination_and_source_nested_are_refused(where: str, source: Path, tmp_path: Path) -> None:
    """``pack SRC SRC/packed`` was accepted: its rerun packed the earlier output as input (a class
    ``packed``, old shards as samples), and --overwrite deleted it first. Refused now, both ways."""
    link = tmp_path / "link"
    link.symlink_to(source)
    src, dest = {"dest-in-source": (source, source / "packed"), "source-in-dest": (source, source.parent),
                 "same": (source, source), "via-symlink": (source, link / "packed")}[where]
    before = sorted(p.name for p in source.iterdir())
    for extra in ((), ("--overwrite",)):
        r = cli("pack", str(src), str(dest), "--quiet", *extra)
        assert r.returncode == 2, r.stderr
        line = one_line(r.stderr)
        assert str(source) in line and ("inside the source" in line or "inside the destination" in line), line
        if where != "source-in-dest":
            assert str(source / "packed") in line or where == "same"
    assert sorted(p.name for p in source.iterdir()) == before
    with pytest.raises(shardkit.errors.ConfigError, match="choose a destination outside the source"):
        shardkit.pack(f"file://{src}", str(dest), progress=False)


def test_destination_inside_a_globbed_source_folder_is_refused(source: Path, tmp_path: Path) -> None:
    """A glob of tars names files that may not exist yet: ``pack 'tars/**/*.tar' tars/out`` would
    read its own earlier shards on a rerun, so the folder the glob starts from counts."""
    tars = tmp_path / "tars"
    shardkit.pack(str(source), str(tars), progress=False)
    with pytest.raises(shardkit.errors.ConfigError, match=f"destination {tars}/out is inside the source {tars}"):
        shardkit.pack(f"{tars}/**/*.tar", str(tars / "out"), progress=False)
    info = shardkit.pack(f"{tars}/shards/*.tar", str(tmp_path / "elsewhere"), progress=False)
    assert info["num_samples"] == shardkit.open_dataset(str(tars)).num_samples


@pytest.mark.parametrize("where", ["dest-in-source", "source-in-dest", "same", "dest-in-globbed-source"])
def test_destination_and_source_nested_in_a_bucket_are_refused(where: str, source: Path, s3_server: Any,
                                                                s3_bucket: str) -> None:
    """The same refusal for a bucket prefix as for a local folder: ``pack s3://b/raw s3://b/raw/out``
    packed, and its rerun (or any later pack of ``s3://b/raw``) took the earlier output's tars,
    manifest and dataset.json as input samples."""
    fs = s3_server.filesystem()
    fs.put(str(source) + "/", f"{s3_bucket[5:]}/raw/", recursive=True)
    before = sorted(fs.find(f"{s3_bucket[5:]}/raw"))
    raw = f"{s3_bucket}/raw"
    src, dest = {"dest-in-source": (raw, f"{raw}/out"), "source-in-dest": (f"{raw}/", s3_bucket),
                 "same": (raw, f"{raw}/"), "dest-in-globbed-source": (f"{raw}/*.tar", f"{raw}/out")}[where]
    for extra in ((), ("--overwrite",)):
        r = cli("pack", src, dest, "--quiet", *extra, env=s3_server.env())
        assert r.returncode == 2, r.stderr
        line = one_line(r.stderr)
        assert raw in line and ("inside the source" in line or "inside the destination" in line), line
    assert sorted(fs.find(f"{s3_bucket[5:]}/raw")) == before
    with pytest.raises(shardkit.errors.ConfigError, match="choose a destination outside the source"):
        shardkit.pack(src, dest, storage_options=s3_server.storage_options(), progress=False)
    # A sibling prefix whose name merely starts alike is not inside.
    info = shardkit.pack(raw, f"{raw}-packed", storage_options=s3_server.storage_options(), progress=False)
    assert info["num_samples"] == shardkit.pack(str(source), f"{s3_bucket}/local", storage_options=s3_server.storage_options(),
                                                progress=False)["num_samples"]


def test_skipped_inputs_are_listed_naming_each_once(tmp_path: Path, s3_server: Any, s3_bucket: str) -> None:
    """The summary printed '<ref>: <reason>' where the reason names the input already:
    's3://b/l.csv: row 1: file list s3://b/l.csv: row 1: ... does not exist'."""
    fs = s3_server.filesystem()
    fs.pipe({f"{s3_bucket[5:]}/o/a.bin": b"a", f"{s3_bucket[5:]}/l.csv": b"path\no/a.bin\no/gone.bin\n"})
    r = cli("pack", f"{s3_bucket}/l.csv", f"{s3_bucket}/ds", "--on-error", "skip", env=s3_server.env())
    assert r.returncode == 0, r.stderr
    listed = [ln for ln in r.stdout.splitlines() if ln.startswith("  ")]
    assert listed == [f"  file list {s3_bucket}/l.csv: row 1: {s3_bucket}/o/gone.bin does not exist"], r.stdout
    warned = [ln for ln in r.stderr.splitlines() if "skipped" in ln]
    assert len(warned) == 1 and warned[0].count(f"{s3_bucket}/l.csv: row 1") == 1, r.stderr


def test_cli_on_s3_never_shows_the_secret(source: Path, s3_server: Any, s3_bucket: str) -> None:
    env = s3_server.env()
    url = f"{s3_bucket}/ds"
    outputs = []
    r = cli("pack", str(source), url, "--shard-size", "4KB", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_samples"] == 12
    outputs.append(r)
    r = cli("info", url, "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["num_shards"] >= 3
    outputs.append(r)
    r = cli("verify", url, "--deep", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True
    outputs.append(r)
    fs = s3_server.filesystem()
    stored = {p: fs.cat_file(p) for p in fs.find(url[len("s3://"):]) if not p.endswith(".tar")}
    assert any(p.endswith("dataset.json") for p in stored) and len(stored) >= 3
    secret = s3_server.secret
    for out in outputs:
        assert secret not in out.stdout and secret not in out.stderr
    for path, data in stored.items():
        assert secret.encode() not in data, path
    ds = shardkit.open_dataset(url, storage_options=s3_server.storage_options())
    assert secret not in repr(ds) and secret not in repr(ds.store)


def test_debug_never_logs_credentials(source: Path, s3_server: Any, s3_bucket: str) -> None:
    # botocore's DEBUG logs print the signed headers: the access key id (Authorization:
    # ... Credential=AKID/...) and the whole x-amz-security-token, a bearer secret.
    token = "SESSIONTOKEN_TOPSECRET_42"
    env = s3_server.env()
    r = cli("--debug", "pack", str(source), f"{s3_bucket}/ds", "--shard-size", "4KB", "--quiet", env=env)
    assert r.returncode == 0, r.stderr
    runs = [r]
    for args in (("--debug", "info", f"{s3_bucket}/ds"), ("--debug", "verify", "--deep", f"{s3_bucket}/ds")):
        r = cli(*args, env=env)
        assert r.returncode == 0, r.stderr
        runs.append(r)
    # With a session token the server refuses the request; --debug still shows the traceback.
    r = cli("--debug", "info", f"{s3_bucket}/nothing", env={**env, "AWS_SESSION_TOKEN": token})
    assert r.returncode != 0 and "Traceback" in r.stderr
    runs.append(r)
    for r in runs:
        for secret in (s3_server.key, s3_server.secret, token):
            assert secret not in r.stdout and secret not in r.stderr, (r.args, secret)


def test_credentials_in_a_url_are_refused_and_never_echoed(source: Path, s3_server: Any, s3_bucket: str,
                                                            tmp_path: Path) -> None:
    bucket = s3_bucket[len("s3://"):]
    url = f"s3://{s3_server.key}:{s3_server.secret}@{bucket}/ds"
    runs = [("info", url), ("verify", url), ("index", url), ("pack", str(source), url),
            ("pack", url + "/*.tar", str(tmp_path / "out")), ("--debug", "info", url)]
    for args in runs:
        r = cli(*args, env=s3_server.env())
        text = r.stdout + r.stderr
        assert s3_server.secret not in text and s3_server.key not in text, (args, text)
        if "--debug" in args:
            continue  # the traceback, without the credentials
        assert r.returncode == 2, (args, r.stderr)
        line = one_line(r.stderr)
        assert f"s3://***@{bucket}/ds" in line and "AWS_" in line and "storage_options" in line, line
    assert s3_server.filesystem().find(bucket) == []
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- 5. corruption


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_verify_reports_corruption_and_missing_shards(source: Path, tmp_path: Path, backend: str,
                                                      request: pytest.FixtureRequest) -> None:
    if backend == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        url, so, env = f"{bucket}/ds", server.storage_options(), server.env()
        fs = server.filesystem()
        base = url[len("s3://"):]
        read = lambda rel: fs.cat_file(f"{base}/{rel}")  # noqa: E731
        write = lambda rel, data: fs.pipe_file(f"{base}/{rel}", data)  # noqa: E731
        delete = lambda rel: fs.rm(f"{base}/{rel}")  # noqa: E731
    else:
        url, so, env = str(tmp_path / "ds"), None, None
        read = lambda rel: (Path(url) / rel).read_bytes()  # noqa: E731
        write = lambda rel, data: (Path(url) / rel).write_bytes(data)  # noqa: E731
        delete = lambda rel: (Path(url) / rel).unlink()  # noqa: E731
    shardkit.pack(str(source), url, shard_bytes="8KB", storage_options=so, progress=False)
    ds = shardkit.open_dataset(url, storage_options=so)
    assert ds.num_shards >= 3
    assert ds.shard_list[1].num_samples >= 2
    victim = ds.shard_samples(1).to_pylist()[-1]  # the last sample of shard 1
    path1 = ds.shards.column("path")[1].as_py()
    field = victim["fields"][0]
    data = bytearray(read(path1))
    data[field["offset"] + field["size"] // 2] ^= 0xFF  # one byte inside the member body
    write(path1, bytes(data))

    r = cli("verify", url, "--deep", env=env)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert path1 in line and victim["key"] in line
    # Sizes still match: the shallow check passes. (Each CLI call on S3 costs seconds, so the
    # S3 case checks some steps through the API that the CLI calls.)
    if backend == "local":
        r = cli("verify", url, env=env)
        assert r.returncode == 0, r.stderr
    assert shardkit.open_dataset(url, storage_options=so).verify()["ok"]
    with pytest.raises(shardkit.errors.IntegrityError, match=victim["key"]):
        shardkit.open_dataset(url, storage_options=so).verify(deep=True)

    # A truncated shard and a deleted shard fail the plain check, naming the shard.
    path2 = ds.shards.column("path")[2].as_py()
    write(path2, read(path2)[:-512])
    if backend == "local":
        r = cli("verify", url, env=env)
        assert r.returncode == 1 and path2 in one_line(r.stderr)
    with pytest.raises(shardkit.errors.IntegrityError, match=path2):
        shardkit.open_dataset(url, storage_options=so).verify()
    write(path2, read(path2) + b"\0" * 512)  # restore the size (the content is intact)
    path0 = ds.shards.column("path")[0].as_py()
    delete(path0)
    r = cli("verify", url, "--json", env=env)
    assert r.returncode == 1 and path0 in one_line(r.stderr)
    assert json.loads(r.stdout)["ok"] is False


def test_verify_names_every_damaged_shard_in_one_run(source: Path, tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    shardkit.pack(str(source), url, shard_bytes="8KB", progress=False)
    ds = shardkit.open_dataset(url)
    flipped, cut = (Path(url) / ds.shard_list[1].path), (Path(url) / ds.shard_list[2].path)
    victim = ds.shard_samples(1).to_pylist()[0]
    data = bytearray(flipped.read_bytes())
    data[victim["fields"][0]["offset"]] ^= 0xFF
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-512])
    r = cli("verify", url, "--deep", "--json")
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert "2 of" in line and victim["key"] in line and ds.shard_list[2].path in line
    failures = json.loads(r.stdout)["failures"]
    assert len(failures) == 2 and ds.shard_list[1].path in failures[0] and ds.shard_list[2].path in failures[1]
    r = cli("verify", url)  # sizes only: the cut shard
    assert r.returncode == 1 and ds.shard_list[2].path in one_line(r.stderr) and "2 of" not in r.stderr


def _edit_json(path: Path, **changes: Any) -> None:
    info = json.loads(path.read_text())
    info.update(changes)
    path.write_text(json.dumps(info))


def test_verify_checks_dataset_json_against_the_manifest_and_readers_refuse_a_count_mismatch(
        source: Path, tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    shardkit.pack(str(source), url, shard_bytes="8KB", progress=False)
    meta = Path(url) / "dataset.json"
    good = meta.read_text()
    _edit_json(meta, num_samples=13)
    r = cli("verify", url)
    assert r.returncode == 1 and "dataset.json says 13 samples" in one_line(r.stderr) and "hold 12" in r.stderr
    for reader in (shardkit.open_dataset, shardkit.StreamingDataset, shardkit.ShardDataset):
        with pytest.raises(shardkit.errors.ManifestError, match=f"{url}: dataset.json says 13 samples"):
            reader(url)
    with pytest.raises(shardkit.errors.IntegrityError, match="dataset.json says 13 samples"):
        shardkit.open_dataset(url, strict=False).verify()
    _edit_json(meta, num_samples=12, total_bytes=5)
    r = cli("verify", url, "--json")
    assert r.returncode == 1 and "dataset.json says 5 total_bytes" in one_line(r.stderr)
    assert json.loads(r.stdout)["ok"] is False
    assert len(shardkit.StreamingDataset(url)) == 12  # a wrong total_bytes does not stop readers
    meta.write_text(good)
    _edit_json(meta, fields=["bin", "jpg", "json"])
    assert cli("verify", url).returncode == 0  # fields are compared with the sample rows by --deep
    r = cli("verify", url, "--deep")
    assert r.returncode == 1 and "fields ['bin', 'jpg', 'json'], the sample rows have ['bin', 'json']" in \
        one_line(r.stderr)


def test_verify_finds_missing_and_short_sample_manifests(source: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    url = str(tmp_path / "ds")
    shardkit.pack(str(source), url, shard_bytes="8KB", progress=False)
    ds = shardkit.open_dataset(url)
    frag = Path(url) / ds.shard_list[0].samples_file
    # One row of shard 0 gone (row groups kept one per shard): both checks read the sample rows.
    pf = pq.ParquetFile(frag)
    with pq.ParquetWriter(tmp_path / "short.parquet", pf.schema_arrow) as w:
        for g in range(pf.num_row_groups):
            rows = pf.read_row_group(g)
            w.write_table(rows.slice(0, rows.num_rows - 1) if g == 0 else rows)
    saved = frag.read_bytes()
    frag.write_bytes((tmp_path / "short.parquet").read_bytes())
    for deep in ((), ("--deep",)):
        r = cli("verify", url, "--json", *deep)
        assert r.returncode == 1
        assert f"shard 0 ({ds.shard_list[0].path})" in one_line(r.stderr) and "manifest rows are" in r.stderr
        assert json.loads(r.stdout)["ok"] is False
    frag.write_bytes(saved)
    frag.unlink()
    for deep in ((), ("--deep",)):  # the plain check sees it too; --deep --json still prints JSON
        r = cli("verify", url, "--json", *deep)
        assert r.returncode == 1 and f"{frag} is missing" in one_line(r.stderr), r.stderr
        out = json.loads(r.stdout)
        assert out["ok"] is False and any(f"{frag} is missing" in f for f in out["failures"])


def test_verify_deep_checks_block_checksums(tmp_path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    url = str(tmp_path / "ds")
    shardkit.pack([{"__key__": "big", "npy": np.zeros(400_000)}, {"__key__": "small", "cls": 1}], url, progress=False)
    frag = next((Path(url) / "manifest").glob("samples-*.parquet"))
    table = pq.read_table(frag)
    blocks = table.column("block_checksums").to_pylist()
    assert blocks[0] is not None and len(blocks[0]) == 4 and blocks[1] is None
    blocks[0][2] ^= 1  # a wrong block checksum for bytes that are right
    i = table.column_names.index("block_checksums")
    pq.write_table(table.set_column(i, "block_checksums", pa.array(blocks, pa.list_(pa.uint64()))), frag)
    assert cli("verify", url).returncode == 0
    r = cli("verify", url, "--deep")
    assert r.returncode == 1 and "sample 'big'" in one_line(r.stderr) and "block 2 fails its block checksum" in r.stderr


def test_unexpected_errors_are_one_line_without_a_traceback(source: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import shardkit.packing.pack
    from shardkit.cli import main

    def fail(*_: Any, **__: Any) -> None:  # (a destination under a file did this; now it is bad usage)
        raise NotADirectoryError(20, "Not a directory", "/x/_pack")

    monkeypatch.setattr(shardkit.packing.pack, "pack", fail)
    assert main(["pack", str(source), str(tmp_path / "ds")]) == 1
    assert one_line(capsys.readouterr().err) == ("shardkit: error: NotADirectoryError: [Errno 20] Not a directory: "
                                                 "'/x/_pack' (--debug shows where)")
    monkeypatch.undo()
    url = str(tmp_path / "ds")
    shardkit.pack(str(source), url, shard_bytes="8KB", progress=False)
    (Path(url) / "manifest" / "shards.parquet").write_bytes(b"garbage")
    for cmd in ("info", "verify"):
        r = cli(cmd, url)
        assert r.returncode == 1 and "shards.parquet" in one_line(r.stderr), r.stderr
    with pytest.raises(shardkit.errors.ManifestError, match="shards.parquet"):
        shardkit.StreamingDataset(url)


# --------------------------------------------------------------------------- 6. no commit


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_destination_without_dataset_json(source: Path, tmp_path: Path, backend: str,
                                          request: pytest.FixtureRequest) -> None:
    if backend == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        url, so, env = f"{bucket}/ds", server.storage_options(), server.env()
    else:
        url, so, env = str(tmp_path / "ds"), None, None
    shardkit.pack(str(source), url, shard_bytes="4KB", storage_options=so, progress=False)
    shardkit.open_dataset(url, storage_options=so)  # committed: opens
    if backend == "s3":
        server.filesystem().rm(f"{url[len('s3://'):]}/dataset.json")
    else:
        (Path(url) / "dataset.json").unlink()
    with pytest.raises(DatasetNotFoundError) as err:
        shardkit.open_dataset(url, storage_options=so)
    assert isinstance(err.value, FileNotFoundError)
    msg = str(err.value)
    assert url in msg and "dataset.json" in msg and "\n" not in msg
    for cmd in ("info", "verify"):
        r = cli(cmd, url, env=env)
        assert r.returncode == 1, r.stderr
        assert "dataset.json" in one_line(r.stderr) and url in r.stderr
    # Nothing at all there: the same clear error.
    empty = f"{url}-never-packed"
    with pytest.raises(DatasetNotFoundError, match="dataset.json"):
        shardkit.open_dataset(empty, storage_options=so)
    if backend == "s3":  # no such bucket: said so
        with pytest.raises(DatasetNotFoundError, match="bucket 'no-such-bucket-shardkit' does not exist"):
            shardkit.open_dataset("s3://no-such-bucket-shardkit/ds", storage_options=so)
        with pytest.raises(shardkit.errors.ConfigError, match="no bucket"):
            shardkit.open_dataset("s3://", storage_options=so)


# --------------------------------------------------------------------------- bench


def test_bench_help_from_the_console_script() -> None:
    """The installed ``shardkit`` finds benchmarks/ in the checkout whatever the cwd, and passes -h through."""
    script = Path(sys.executable).parent / "shardkit"
    if not script.is_file():
        pytest.skip("no shardkit console script next to the interpreter (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user runs it
    for flag in ("--help", "-h"):
        r = subprocess.run([str(script), "bench", flag], capture_output=True, text=True, env=env, timeout=120,
                           cwd="/tmp")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("usage: shardkit bench"), r.stdout
        for option in ("--quick", "--images", "--no-peers", "--out"):
            assert option in r.stdout, r.stdout


def test_bench_from_an_installed_package(tmp_path: Path) -> None:
    """An installed shardkit (no checkout beside it) finds benchmarks/ in the current directory,
    and elsewhere says in one line where the benchmarks live (exit 2), without a traceback."""
    import shutil

    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "shardkit", site / "shardkit", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, "-m", "shardkit.cli", "bench", "--quick"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=elsewhere)
    assert r.returncode == 2, r.stderr
    line = one_line(r.stderr)
    assert "benchmarks/" in line and "make bench" in line, line
    r = subprocess.run([sys.executable, "-m", "shardkit.cli", "bench", "--help"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=REPO)
    assert r.returncode == 0 and r.stdout.startswith("usage: shardkit bench"), r.stdout + r.stderr


@pytest.mark.parametrize("samples, seconds, shown", [
    (2, 5.8, "2.9 s/sample"),          # huge samples: was "0 samples/s"
    (1, 0.5, "2.0 samples/s"),
    (3, 1.0, "3.0 samples/s"),
    (10, 1.0, "10 samples/s"),
    (500_000, 47.0, "10638 samples/s"),
    (0, 1.0, "0 samples/s"),
    (5, 0.0, "5000000000 samples/s"),  # no time measured: no division by zero
])
def test_pack_summary_rate_is_never_rounded_to_zero(samples: int, seconds: float, shown: str) -> None:
    from shardkit.cli import sample_rate

    assert sample_rate(samples, seconds) == shown


def test_info_into_a_closed_pipe_exits_quietly(source: Path, tmp_path: Path) -> None:
    # `shardkit info URL | head -1`: the reader may be gone before shardkit writes.
    url = str(tmp_path / "ds")
    shardkit.pack(str(source), url, shard_bytes="4KB", progress=False)
    p = subprocess.Popen([sys.executable, "-m", "shardkit.cli", "info", url], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout is not None
    p.stdout.close()  # before the command has started: its first write finds no reader
    _, err = p.communicate(timeout=60)
    assert err == "" and p.returncode == 141


# --------------------------------------------------------------------------- subsets and side columns


def _labelled(dest: str) -> None:
    shardkit.pack(iter({"__key__": f"k{i:03d}", "bin": bytes([i % 256]) * (100 + i), "__meta__": {"label": i % 10}}
                       for i in range(60)), dest, shard_samples=10, progress=False)


def test_info_where_prints_the_selected_count_and_bytes(tmp_path: Path) -> None:
    dest = str(tmp_path / "ds")
    _labelled(dest)
    r = cli("info", dest, "--where", "label < 3")
    assert r.returncode == 0, r.stderr
    size = sum(100 + i for i in range(60) if i % 10 < 3)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("selected")]
    assert len(line) == 1 and line[0].startswith("selected  18 of 60 samples (") and "where label < 3" in line[0]
    r = cli("info", dest, "--where", "label < 3", "--json")
    selected = json.loads(r.stdout)["selected"]
    assert selected["num_samples"] == 18 and selected["where"] == "label < 3"
    assert size < selected["bytes"] < size + 60 * 2048  # the samples' tar members, headers included
    r = cli("info", dest, "--where", "lable < 3")
    assert r.returncode == 2 and "lable" in one_line(r.stderr) and "columns: key, shard" in r.stderr


def test_annotate_round_trip_and_a_bad_table_in_one_line(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    dest = str(tmp_path / "ds")
    _labelled(dest)
    table = tmp_path / "scores.parquet"
    pq.write_table(pa.table({"key": [f"k{i:03d}" for i in range(0, 60, 3)], "score": list(range(0, 60, 3))}), table)
    r = cli("annotate", dest, str(table), "--on", "key")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("annotated 20 samples with score at ") and "manifest/annotations/scores.parquet" in r.stdout
    r = cli("info", dest, "--where", "score >= 30 AND label < 5", "--json")
    assert json.loads(r.stdout)["selected"]["num_samples"] == len([i for i in range(30, 60, 3) if i % 10 < 5])
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"key": ["k001", "zzz", "yyy"], "x": [1, 2, 3]}), bad)
    r = cli("annotate", dest, str(bad))
    assert r.returncode == 2, r.stderr
    assert "2 key value(s) are not in" in one_line(r.stderr) and "'yyy', 'zzz'" in r.stderr
