"""shardkit.storage: retry classification, error translation, redaction, resumed fetches, fork safety."""

from __future__ import annotations

import errno
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import botocore.exceptions
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from conftest import S3Server

import shardkit
from shardkit.errors import ConfigError, StorageError, StoragePermissionError
from shardkit.storage import ranged, resumable, retry, urls
from shardkit.storage.retry import is_transient, retrying, translate
from shardkit.storage.store import Store

SECRET = "s3cr3t-" + "x" * 20


def client_error(code: str, message: str = "boom") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, "GetObject")


@pytest.fixture
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry.time, "sleep", lambda _s: None)


# --------------------------------------------------------------------------- classification


@pytest.mark.parametrize("exc", [
    ConnectionError("reset"), TimeoutError("slow"), OSError(errno.ECONNRESET, "reset by peer"),
    OSError(errno.EIO, "io"), client_error("SlowDown", "Please reduce your request rate"),
    client_error("ServiceUnavailable"), client_error("503"), client_error("InternalError"),
    OSError("IncompleteRead(10 bytes read)"),
    # s3fs's translation of a 500 (and of a listing whose XML it could not parse)
    OSError(errno.EREMOTEIO, "Internal Server Error"),
    # botocore's response checksum failed: bytes damaged in transit
    botocore.exceptions.FlexibleChecksumError(error_msg="Expected checksum RcKAVQ== did not match calculated checksum: ZvYUQQ=="),
])
def test_transient_faults_are_retried(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    PermissionError("denied"), FileNotFoundError("gone"), FileExistsError("there"),
    StorageError("already ours"), client_error("NoSuchKey"), client_error("AccessDenied"),
    client_error("InvalidAccessKeyId"), client_error("SignatureDoesNotMatch"), client_error("PreconditionFailed"),
    ValueError("a bug, not a fault"),
])
def test_permanent_faults_are_not_retried(exc: BaseException) -> None:
    assert not is_transient(exc)


@pytest.mark.parametrize(("exc", "cls", "fragment"), [
    (client_error("NoSuchKey"), StorageError, "not found"),
    (client_error("NoSuchBucket"), StorageError, "not found"),
    (client_error("AccessDenied"), StoragePermissionError, "access denied"),
    (client_error("SignatureDoesNotMatch"), StoragePermissionError, "check credentials"),
    (PermissionError("nope"), StoragePermissionError, "access denied"),
    (FileNotFoundError("gone"), StorageError, "not found"),
    (ConnectionError("refused"), StorageError, "cannot reach storage"),
    (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), StorageError, "cannot reach storage"),
    (client_error("SlowDown"), StorageError, "storage error"),
])
def test_translate_maps_codes_and_names_the_object(exc: BaseException, cls: type, fragment: str) -> None:
    err = translate(exc, "shards/000001.tar", "s3://bucket/ds (endpoint http://127.0.0.1:9000)")
    assert type(err) is cls
    assert isinstance(err, OSError)  # what users already catch
    msg = str(err)
    assert fragment in msg and "shards/000001.tar" in msg and "s3://bucket/ds" in msg
    assert "\n" not in msg


def test_translate_keeps_shardkit_errors() -> None:
    err = StorageError("mine")
    assert translate(err, "x", "y") is err


def test_no_secret_in_store_repr_where_or_errors() -> None:
    opts = {"key": "AKIDEXAMPLE", "secret": SECRET,
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:1", "region_name": "us-east-1"}}
    store = Store("s3://bucket/ds", storage_options=opts)
    assert SECRET not in repr(store)
    assert SECRET not in store.where and "http://127.0.0.1:1" in store.where
    for exc in (client_error("AccessDenied"), client_error("SlowDown"), ConnectionError("refused")):
        assert SECRET not in str(translate(exc, "dataset.json", store.where))


@pytest.mark.parametrize("url", [
    "s3://AKIDEXAMPLE:{s}@bucket/ds",
    "s3://AKIDEXAMPLE:ab/{s}+c@bucket/ds",  # AWS secret keys may hold '/'
    "simplecache::s3://AKIDEXAMPLE:{s}@bucket/ds",
    "https://user:{s}@example.com/ds",
])
def test_credentials_in_a_url_are_refused_without_repeating_them(url: str, tmp_path: Any) -> None:
    url = url.format(s=SECRET)
    calls: list[Any] = [
        lambda: Store(url),
        lambda: shardkit.open_dataset(url),
        lambda: shardkit.StreamingDataset(url),
        lambda: shardkit.pack([{"__key__": "a", "txt": b"x"}], url),
        lambda: shardkit.pack(url, str(tmp_path / "out")),  # as the source
        lambda: shardkit.index_tars(url),
    ]
    for call in calls:
        with pytest.raises(ConfigError) as info:
            call()
        text = str(info.value)
        assert SECRET not in text and "AKIDEXAMPLE" not in text and "***@" in text, text
        assert "storage_options" in text and "AWS_" in text and "\n" not in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("url", ["s3:/bucket/ds", "s3:bucket/ds", "S3:/bucket/ds", "gs:/bucket/ds"])
def test_a_url_missing_its_slashes_is_refused_not_written_locally(url: str, tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``s3:/bucket/ds`` (one slash) is also a relative local path: a pack to it used to write the
    dataset under a folder named ``s3:`` in the working directory, exit 0."""
    monkeypatch.chdir(tmp_path)
    calls: list[Any] = [
        lambda: Store(url),
        lambda: shardkit.open_dataset(url),
        lambda: shardkit.StreamingDataset(url),
        lambda: shardkit.pack([{"__key__": "a", "txt": b"x"}], url, progress=False),
    ]
    for call in calls:
        with pytest.raises(ConfigError) as info:
            call()
        text = str(info.value)
        assert repr(url) in text and "://bucket" in text and "\n" not in text, text
    assert list(tmp_path.iterdir()) == []
    Store(f"./{url}")  # a local folder named so is still reachable, spelled as a path


def test_redact_url_leaves_urls_without_credentials_alone() -> None:
    for url in ("s3://bucket/user@example.com/ds", "http://host:8080/a@b", "/tmp/a@b", "file:///tmp/x@y",
                "memory://ds", "s3://bucket/ds"):
        assert urls.redact_url(url) == url
    assert urls.redact_url("s3://K:S@b/ds") == "s3://***@b/ds"


def test_endpoint_with_credentials_is_redacted_in_messages() -> None:
    store = Store("s3://bucket/ds", {"client_kwargs": {"endpoint_url": f"http://u:{SECRET}@127.0.0.1:1"}})
    assert SECRET not in store.where and "http://***@127.0.0.1:1" in store.where


# --------------------------------------------------------------------------- retrying


def flaky(failures: list[BaseException], result: Any = "ok") -> tuple[Any, list[int]]:
    calls: list[int] = []

    def fn() -> Any:
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return result

    return fn, calls


def test_retrying_recovers_from_transient_faults(no_sleep: None) -> None:
    fn, calls = flaky([ConnectionError("reset"), client_error("SlowDown")])
    assert retrying(fn, "obj", "here") == "ok"
    assert len(calls) == 3


def test_retrying_gives_up_after_attempts_with_a_translated_error(no_sleep: None) -> None:
    fn, calls = flaky([ConnectionResetError("reset")] * 10)
    with pytest.raises(StorageError, match="obj") as info:
        retrying(fn, "obj", "here", attempts=4)
    assert len(calls) == 4
    assert isinstance(info.value.__cause__, ConnectionResetError)


def test_a_stalled_store_is_given_up_sooner_and_said(no_sleep: None, caplog: pytest.LogCaptureFixture) -> None:
    # Each stall costs a whole read timeout: three in a row end it, each retry logged.
    from shardkit.storage.retry import TIMEOUT_ATTEMPTS

    fn, calls = flaky([TimeoutError("timed out")] * 10)
    with caplog.at_level("WARNING", logger="shardkit"), pytest.raises(StorageError, match="did not answer for obj"):
        retrying(fn, "obj", "here", attempts=6)
    assert len(calls) == TIMEOUT_ATTEMPTS < 6
    assert caplog.text.count("storage: no answer for obj at here") == TIMEOUT_ATTEMPTS - 1


def test_retrying_does_not_retry_permanent_faults(no_sleep: None) -> None:
    fn, calls = flaky([client_error("AccessDenied")])
    with pytest.raises(StoragePermissionError, match="AccessDenied"):
        retrying(fn, "obj", "here")
    assert len(calls) == 1


def test_retrying_passes_shardkit_errors_through(no_sleep: None) -> None:
    fn, calls = flaky([StorageError("already translated")])
    with pytest.raises(StorageError, match="already translated"):
        retrying(fn, "obj", "here")
    assert len(calls) == 1


def test_dead_endpoint_fails_fast(no_sleep: None) -> None:
    fn, calls = flaky([EndpointConnectionError(endpoint_url="http://127.0.0.1:1")] * 10)
    with pytest.raises(StorageError, match="cannot reach storage"):
        retrying(fn, "obj", "here")
    assert len(calls) == retry.CONNECT_ATTEMPTS


# --------------------------------------------------------------------------- stream reader resume


@pytest.fixture
def mem_store() -> Iterator[tuple[Store, bytes]]:
    root = f"memory://test-storage-{os.getpid()}-{id(object())}"
    store = Store(root)
    payload = os.urandom(300_000)
    store.put_bytes("shards/a.tar", payload)
    try:
        yield store, payload
    finally:
        store.remove("", recursive=True)


class _Cut(resumable.Body):
    """A response body that ends after ``keep`` bytes, as after a dropped connection."""

    def __init__(self, body: resumable.Body, keep: int) -> None:
        self.body, self.keep = body, keep

    def readinto(self, out: memoryview) -> int:
        n = self.body.readinto(out[:self.keep])
        self.keep -= n
        return n

    def close(self, complete: bool) -> None:
        self.body.close(complete)


def test_stream_reader_resumes_after_a_truncated_body(mem_store: tuple[Store, bytes], no_sleep: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store, payload = mem_store
    real = ranged.opener
    requests: list[tuple[int, int]] = []

    def truncating(store: Store, path: str, client: Any) -> resumable.Opener:
        open_body = real(store, path, client)

        def open_cut(pos: int, end: int) -> resumable.Body:
            requests.append((pos, end))
            body = open_body(pos, end)
            return _Cut(body, 1234) if len(requests) == 1 else body  # the first body ends early
        return open_cut

    monkeypatch.setattr(ranged, "opener", truncating)
    out = bytearray(249_000)
    counter = ranged.ByteCounter()
    ranged.read_fully(ranged.StreamReader(store, "shards/a.tar", 250_000, counter=counter), 1000, memoryview(out),
                      "shards/a.tar")
    assert bytes(out) == payload[1000:250_000]
    assert requests == [(1000, 250_000), (2234, 250_000)]  # resumed from the byte it reached
    assert counter.snapshot() == {"bytes": 249_000, "requests": 2}


def test_stream_reader_gives_up_naming_the_object(mem_store: tuple[Store, bytes], no_sleep: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = mem_store
    real = ranged.opener
    calls: list[int] = []

    def empty(store: Store, path: str, client: Any) -> resumable.Opener:
        open_body = real(store, path, client)

        def open_empty(pos: int, end: int) -> resumable.Body:
            calls.append(pos)
            return _Cut(open_body(pos, end), 0)
        return open_empty

    monkeypatch.setattr(ranged, "opener", empty)
    with pytest.raises(StorageError, match="shards/a.tar"):
        ranged.StreamReader(store, "shards/a.tar", 100).read_into(0, memoryview(bytearray(100)))
    assert len(calls) == retry.RETRY_ATTEMPTS


# --------------------------------------------------------------------------- fork safety


def _read_in_child(store: Store, parent_fs_id: int, queue: Any) -> None:
    try:
        data = store.read_bytes("obj.bin")
        part = ranged.read_range(store, "obj.bin", 10, 20).tobytes()
        queue.put((data, part, id(store.fs) != parent_fs_id))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.s3
@pytest.mark.timeout(120)
def test_store_used_in_parent_then_forked_child(s3_server: S3Server, s3_bucket: str) -> None:
    payload = os.urandom(50_000)
    store = Store(f"{s3_bucket}/ds", storage_options=s3_server.storage_options())
    store.put_bytes("obj.bin", payload)
    assert store.read_bytes("obj.bin") == payload  # the parent's s3fs session and loop are live now
    parent_fs = store.fs

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(store, id(parent_fs), queue))
    child.start()
    try:
        got = queue.get(timeout=90)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
    assert not isinstance(got, str), got
    data, ranged, reopened = got
    assert data == payload and ranged == payload[10:20]
    assert reopened, "the child kept the parent's s3fs instance"
    assert child.exitcode == 0
    assert store.fs is parent_fs and store.read_bytes("obj.bin") == payload  # the parent is untouched



def test_with_env_location_pins_endpoint_and_region_never_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardkit.storage.options import with_env_location

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDNEVERSHIPPED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secretneverShipped")
    got = with_env_location("s3://b/ds", {"anon": False})
    assert got == {"anon": False, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-3"}}
    assert "NEVERSHIPPED" not in repr(got) and "neverShipped" not in repr(got)
    explicit = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:7"}}
    assert with_env_location("s3://b/ds", explicit)["client_kwargs"] == {"endpoint_url": "http://127.0.0.1:7",
                                                                         "region_name": "eu-west-3"}
    assert with_env_location("s3://b/ds", {"endpoint_url": "http://127.0.0.1:8"}) == {"endpoint_url": "http://127.0.0.1:8"}
    assert with_env_location("/local/ds", {}) == {}
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    assert with_env_location("s3://b/ds", {"anon": False}) == {"anon": False}


def test_ray_tasks_read_s3_tars_where_the_driver_does(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from shardkit.packing.engines.ray import for_tasks
    from shardkit.packing.sources import FolderSource
    from shardkit.packing.sources.wds import WdsTarSource

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    src = WdsTarSource("s3://b/tars/*.tar", storage_options={"key": "k", "secret": "s"})
    pinned = for_tasks(src)
    assert pinned is not src and pinned.urls == src.urls
    assert pinned.storage_options is not None and pinned.storage_options["key"] == "k"
    assert pinned.storage_options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9"
    assert src.storage_options == {"key": "k", "secret": "s"}  # the driver's own is untouched
    local = WdsTarSource(str(tmp_path))
    assert for_tasks(local) is local
    folder = FolderSource(tmp_path)
    assert for_tasks(folder) is folder


@pytest.mark.s3
@pytest.mark.timeout(180)
def test_dataloader_workers_print_no_event_loop_tracebacks(s3_server: S3Server, s3_bucket: str, tmp_path: Any) -> None:
    # Forked workers inherit the parent's s3fs instance; collected there, it closed its
    # aiobotocore session on the parent's loop: "Task exception was never retrieved ...
    # attached to a different loop", twice per run, on a dataset read cold without a cache.
    import subprocess
    import sys

    import shardkit

    url = f"{s3_bucket}/ds"
    shardkit.pack([{"__key__": f"k{i}", "bin": bytes([i]) * 3000} for i in range(200)], url, shard_bytes="100KB",
                  storage_options=s3_server.storage_options(), progress=False)
    code = (f"import shardkit; loader = shardkit.StreamingDataLoader(shardkit.StreamingDataset({url!r}, batch_size=16), "
            "num_workers=2); print(sum(len(b['__key__']) for b in loader))")
    env = {**os.environ, **s3_server.env(), "TMPDIR": str(tmp_path)}  # cold manifest copies
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=150)
    assert r.returncode == 0 and r.stdout.split() == ["200"], r.stderr[-2000:]
    assert "different loop" not in r.stderr and "Task exception" not in r.stderr, r.stderr[-2000:]


# --------------------------------------------------------------------------- storage_options keys


@pytest.mark.parametrize(("key", "spelling"), [
    ("aws_access_key_id", "'key'"), ("aws_secret_access_key", "'secret'"), ("aws_session_token", "'token'"),
    ("region_name", "client_kwargs={'region_name': ...}"), ("endpoint", "'endpoint_url'"),
])
def test_boto3_spellings_in_s3_storage_options_are_refused_naming_the_s3fs_one(key: str, spelling: str) -> None:
    # s3fs hands unknown keys to its botocore session: "TypeError: AioSession.__init__() got an
    # unexpected keyword argument", inside a StorageError, at the first call.
    for url in ("s3://bucket/ds", "s3a://bucket/ds"):
        with pytest.raises(ConfigError) as info:
            Store(url, {"key": "AKIDEXAMPLE", key: SECRET})
        text = str(info.value)
        assert repr(key) in text and spelling in text and url in text
        assert SECRET not in text and "\n" not in text
    with pytest.raises(ConfigError, match="aws_secret_access_key"):
        shardkit.open_dataset("s3://bucket/ds", storage_options={"aws_secret_access_key": SECRET})


def test_unknown_s3_storage_options_key_lists_what_s3fs_takes() -> None:
    with pytest.raises(ConfigError, match=r"'no_such_option' is not an s3fs option.*s3fs takes .*endpoint_url") as info:
        Store("s3://bucket/ds", {"no_such_option": 1})
    assert "\n" not in str(info.value)


def test_s3fs_options_and_other_protocols_pass_through(tmp_path: Any) -> None:
    opts = {"key": "k", "secret": "s", "token": "t", "endpoint_url": "http://127.0.0.1:1", "profile": "p",
            "client_kwargs": {"region_name": "eu-west-3"}, "config_kwargs": {}, "anon": False,
            "use_listings_cache": False, "skip_instance_cache": True, "requester_pays": True}
    assert Store("s3://bucket/ds", opts).storage_options == opts
    assert Store(str(tmp_path), {"aws_access_key_id": "x", "anything": 1}).storage_options["anything"] == 1
    assert Store("memory://ds", {"whatever": True}).storage_options == {"whatever": True}


def test_ranged_reader_reports_each_part_piece_by_piece_once_its_bytes_are_in(
        mem_store: tuple[Store, bytes], no_sleep: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader of a shard still landing uses a part's first bytes before its last arrive: each
    part is reported in pieces, in order, each starting block-aligned and holding its bytes."""
    store, payload = mem_store
    monkeypatch.setattr(ranged, "_READ_CHUNK", 10_000)  # a piece every ~10 KB of a part
    real = ranged.opener

    def short_reads(store: Store, path: str, client: Any) -> resumable.Opener:
        open_body = real(store, path, client)
        return lambda pos, end: _Cut(open_body(pos, end), 7_777)  # a body that ends early, resumed
    monkeypatch.setattr(ranged, "opener", short_reads)
    out = bytearray(300_000)
    view = memoryview(out)
    pieces: list[tuple[int, int]] = []

    def on_part(lo: int, hi: int) -> None:
        assert bytes(view[lo:hi]) == payload[lo:hi]  # all of it is in when reported
        pieces.append((lo, hi))

    ranged.RangedReader(store, "shards/a.tar", part_size=100_000, concurrency=3).read_into(0, view, on_part)
    assert bytes(out) == payload
    by_part: dict[int, list[tuple[int, int]]] = {}
    for lo, hi in pieces:
        by_part.setdefault(lo // 100_000, []).append((lo, hi))
    assert sorted(by_part) == [0, 1, 2]
    for part, got in by_part.items():
        assert got[0][0] == part * 100_000 and got[-1][1] == (part + 1) * 100_000
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))  # in order, no gap, no overlap
        assert all(lo % 4096 == 0 or lo == part * 100_000 for lo, _ in got)
        assert len(got) > 5  # reported as it went, not once at the end
