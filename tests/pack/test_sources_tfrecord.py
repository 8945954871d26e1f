"""TfRecordSource, the TFRecord framing and the tf.train.Example decoder.

TFRecords are written by a small writer of our own in tests/tfrecords.py (``encode_example``, unpacked
repeated fields, and ``frame``), which is checked against facts from outside shardkit:
the CRC-32C check values of RFC 3720 and the protobuf library's own parser of the Example
schema (built from its descriptor, no TensorFlow needed).
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardkit
from shardkit.errors import SourceError
from shardkit.packing.sources import tfrecord_frame
from shardkit.packing.sources.resolve import resolve_source
from shardkit.packing.sources.tf_example import parse_example
from shardkit.packing.sources.tfrecord import TfRecordSource, is_tfrecord_name
from shardkit.packing.sources.tfrecord_frame import crc32c, frame, masked_crc
from tfrecords import encode_example, len_field, write_tfrecord

JPEG = b"\xff\xd8\xff\xe0" + bytes(range(256)) * 3  # payload bytes only: not decoded by the source


def sample_examples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"image/encoded": [JPEG + bytes([i])], "image/format": [b"jpeg"], "label": [i % 3],
             "bbox": rng.standard_normal(4).astype(np.float32), "tokens": [-1, 2**40, i],
             "caption.txt": [f"caption {i}".encode()], "parts": [b"a", b"bb"]} for i in range(n)]


# -- facts from outside -------------------------------------------------------------------------

def test_crc32c_matches_rfc3720_check_values():
    # RFC 3720 B.4 (iSCSI CRC32C examples), and the CRC catalogue's check value for "123456789".
    facts = {b"123456789": 0xE3069283, bytes(32): 0x8A9136AA, b"\xff" * 32: 0x62A8AB43,
             bytes(range(32)): 0x46DD794E}
    for data, crc in facts.items():
        assert crc32c(data) == crc
        assert tfrecord_frame._crc32c_python(data) == crc  # the fallback without google_crc32c
    # The mask of record_writer.cc / crc32c.h: rotate right by 15 bits, add 0xa282ead8.
    crc = 0xE3069283
    assert masked_crc(b"123456789") == ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _protobuf_example_class():
    """tf.train.Example built by the protobuf library from its schema (feature.proto, example.proto)."""
    pb = pytest.importorskip("google.protobuf")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    del pb
    f = descriptor_pb2.FileDescriptorProto(name="shardkit_test_example.proto", package="tf", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto
    rep = T.LABEL_REPEATED

    def msg(name, *fields, options=None):
        m = f.message_type.add(name=name)
        if options:
            m.options.map_entry = True
        for fname, number, ftype, type_name, label in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = type_name
        return m

    msg("BytesList", ("value", 1, T.TYPE_BYTES, None, rep))
    msg("FloatList", ("value", 1, T.TYPE_FLOAT, None, rep))
    msg("Int64List", ("value", 1, T.TYPE_INT64, None, rep))
    feat = msg("Feature", ("bytes_list", 1, T.TYPE_MESSAGE, ".tf.BytesList", T.LABEL_OPTIONAL),
               ("float_list", 2, T.TYPE_MESSAGE, ".tf.FloatList", T.LABEL_OPTIONAL),
               ("int64_list", 3, T.TYPE_MESSAGE, ".tf.Int64List", T.LABEL_OPTIONAL))
    feat.oneof_decl.add(name="kind")
    for fd in feat.field:
        fd.oneof_index = 0
    feats = msg("Features", ("feature", 1, T.TYPE_MESSAGE, ".tf.Features.FeatureEntry", rep))
    entry = feats.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=T.TYPE_MESSAGE, type_name=".tf.Feature", label=T.LABEL_OPTIONAL)
    msg("Example", ("features", 1, T.TYPE_MESSAGE, ".tf.Features", T.LABEL_OPTIONAL))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tf.Example"))


@pytest.mark.parametrize("packed", [False, True])
def test_our_writer_and_decoder_agree_with_protobuf(packed):
    Example = _protobuf_example_class()
    values = {"b": [b"x", b"", b"\x00" * 300], "i": [0, -1, 2**63 - 1, -(2**63), 300], "f": [1.5, -0.0, 3e38]}
    ours = encode_example(values, packed=packed)
    theirs = Example.FromString(ours)  # protobuf reads our bytes as the same Example
    assert list(theirs.features.feature["b"].bytes_list.value) == values["b"]
    assert list(theirs.features.feature["i"].int64_list.value) == values["i"]
    assert list(theirs.features.feature["f"].float_list.value) == list(np.float32(values["f"]))
    # And we read protobuf's own encoding (packed, proto3) the same way.
    decoded = parse_example(theirs.SerializeToString())
    assert decoded["b"].values == values["b"]
    assert decoded["i"].values.dtype == np.int64 and decoded["i"].values.tolist() == values["i"]
    assert decoded["f"].values.dtype == np.float32 and decoded["f"].values.tolist() == np.float32(values["f"]).tolist()
    assert {k: (v.kind, list(v.values)) for k, v in parse_example(ours).items()} == \
           {k: (v.kind, list(v.values)) for k, v in decoded.items()}


# -- the decoder under fuzzing ------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_raises_only_source_error(data):
    poisoned = memoryview(data + b"\x0a\xff\xff\xff\x0f")[:len(data)]  # a read past the end would see these
    try:
        got = parse_example(data)
    except SourceError:
        with pytest.raises(SourceError):
            parse_example(poisoned)
        return
    assert {k: (v.kind, list(v.values)) for k, v in parse_example(poisoned).items()} == \
           {k: (v.kind, list(v.values)) for k, v in got.items()}


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decoder_on_mutated_examples(data):
    valid = encode_example(sample_examples(1)[0], packed=data.draw(st.booleans()))
    pos = data.draw(st.integers(0, len(valid) - 1))
    mutated = bytearray(valid)
    mutated[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(mutated)))
    try:
        parse_example(bytes(mutated[:cut]))
    except SourceError:
        pass


# -- packing ------------------------------------------------------------------------------------

def _expected(i: int, ex: dict) -> dict[str, bytes]:
    def npy(a):
        buf = io.BytesIO()
        np.save(buf, a)
        return buf.getvalue()

    return {"image.jpg": ex["image/encoded"][0], "image_format": b"jpeg", "cls": str(i % 3).encode(),
            "bbox.npy": npy(np.asarray(ex["bbox"], np.float32)), "tokens.npy": npy(np.array(ex["tokens"], np.int64)),
            "caption.txt": ex["caption.txt"][0], "parts_0": b"a", "parts_1": b"bb"}


def make_tfrecords(root: Path, files: int = 2, per_file: int = 5) -> dict[str, dict[str, bytes]]:
    """``files`` TFRecord files under ``root``; returns key -> expected fields."""
    expected = {}
    for f in range(files):
        examples = sample_examples(per_file, seed=f)
        write_tfrecord(root / "sub" / f"train.tfrecord-{f:05d}-of-{files:05d}", [encode_example(e) for e in examples])
        for i, ex in enumerate(examples):
            expected[f"sub_train-{f:05d}-of-{files:05d}-{i:09d}"] = _expected(i, ex)
    return expected


def _read_back(url: str, opts=None) -> tuple[dict[str, dict[str, bytes]], dict]:
    ds = shardkit.open_dataset(url, storage_options=opts)
    got = {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")} for s in ds.iter_samples()}
    return got, ds


def test_pack_round_trip_exact(tmp_path):
    expected = make_tfrecords(tmp_path / "src")
    assert isinstance(resolve_source(tmp_path / "src"), TfRecordSource)
    info = shardkit.pack(str(tmp_path / "src"), str(tmp_path / "ds"), progress=False, shard_samples=4)
    assert info["num_samples"] == 10 and info["source"]["type"] == "tfrecord"
    got, ds = _read_back(str(tmp_path / "ds"))
    assert got == expected
    rows = ds.samples.to_pylist()
    assert [r["key"] for r in rows] == sorted(expected)  # file order, then record order
    assert rows[6]["source"] == "sub/train.tfrecord-00001-of-00002" and rows[6]["record"] == 1
    arr = np.load(io.BytesIO(got["sub_train-00000-of-00002-000000004"]["tokens.npy"]))
    assert arr.dtype == np.int64 and arr.shape == (3,) and arr.tolist() == [-1, 2**40, 4]


def test_single_file_resolves(tmp_path):
    path = write_tfrecord(tmp_path / "a.tfrecords", [encode_example({"x": [b"1"]})])
    assert is_tfrecord_name("a.tfrecords") and is_tfrecord_name("train.tfrecord-00001-of-00010")
    assert not is_tfrecord_name("notes.txt")
    info = shardkit.pack(str(path), str(tmp_path / "ds"), progress=False)
    assert info["num_samples"] == 1
    got, _ = _read_back(str(tmp_path / "ds"))
    assert got == {"a-000000000": {"x": b"1"}}


def _corrupt(tmp_path: Path) -> tuple[Path, int]:
    """3 records; the middle one's payload has a flipped byte. Returns the file and its offset."""
    records = [frame(encode_example({"x": [bytes([i]) * 10]})) for i in range(3)]
    bad = bytearray(records[1])
    bad[15] ^= 0xFF
    path = tmp_path / "src" / "c.tfrecord"
    path.parent.mkdir(parents=True)
    path.write_bytes(records[0] + bytes(bad) + records[2])
    return path, len(records[0])


def test_corrupt_crc_one_line_and_skip(tmp_path):
    path, offset = _corrupt(tmp_path)
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(path), str(tmp_path / "ds"), progress=False)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "record 1" in msg and f"byte {offset}" in msg and "CRC" in msg, msg
    info = shardkit.pack(str(path), str(tmp_path / "ds2"), progress=False, on_error="skip")
    assert info["num_samples"] == 2
    assert [s["key"] for s in info["skipped"]] == ["c-000000001"] and "data CRC mismatch" in info["skipped"][0]["reason"]


def test_truncated_file_one_line_and_skip(tmp_path):
    records = [frame(encode_example({"x": [bytes([i]) * 100]})) for i in range(3)]
    path = tmp_path / "t.tfrecord"
    path.write_bytes(b"".join(records)[:-50])
    with pytest.raises(SourceError) as err:
        shardkit.pack(str(path), str(tmp_path / "ds"), progress=False)
    msg = str(err.value)
    offset = 2 * len(records[0])
    assert "\n" not in msg and str(path.name) in msg and "record 2" in msg and f"byte {offset}" in msg
    assert "truncated" in msg, msg
    info = shardkit.pack(str(path), str(tmp_path / "ds2"), progress=False, on_error="skip")
    assert info["num_samples"] == 2 and len(info["skipped"]) == 1 and "truncated" in info["skipped"][0]["reason"]


def test_gzip_refused_in_one_line(tmp_path):
    path = tmp_path / "z.tfrecord"
    path.write_bytes(gzip.compress(frame(encode_example({"x": [b"1"]}))))
    with pytest.raises(SourceError, match="gzip-compressed TFRecord") as err:
        shardkit.pack(str(path), str(tmp_path / "ds"), progress=False)
    assert "\n" not in str(err.value)


@pytest.mark.s3
def test_gzip_named_tfrecord_refused_saying_to_decompress(tmp_path, s3_server, s3_bucket):
    """A ``train.tfrecord.gz`` (TensorFlow's own name for its GZIP option's output) is refused as
    a gzip-compressed TFRecord, on disk and in a bucket, not as an unknown ``.gz`` file type."""
    path = tmp_path / "train.tfrecord.gz"
    path.write_bytes(gzip.compress(frame(encode_example({"x": [b"1"]}))))
    s3_server.filesystem().put(str(path), f"{s3_bucket[5:]}/raw/train.tfrecord.gz")
    for source in (str(path), f"{s3_bucket}/raw/train.tfrecord.gz"):
        with pytest.raises(SourceError) as err:
            shardkit.pack(source, f"{s3_bucket}/ds", storage_options=s3_server.storage_options(), progress=False)
        message = str(err.value)
        assert "\n" not in message and source in message
        assert "gzip-compressed TFRecord" in message and "decompress it (gunzip)" in message


@pytest.mark.s3
def test_a_folder_of_gzipped_tfrecords_is_refused_not_packed_as_blobs(tmp_path, s3_server, s3_bucket):
    """A folder (or bucket prefix) of ``*.tfrecord.gz`` used to pack as a keyed folder: each file
    one sample of field ``tfrecord.gz``, exit 0. It is refused as gzip-compressed TFRecords."""
    src = tmp_path / "src"
    for name in ("a.tfrecord.gz", "sub/b.tfrecord.gz", "c.tfrecord"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        data = frame(encode_example({"x": [name.encode()]}))
        (src / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    s3_server.filesystem().put(str(src) + "/", f"{s3_bucket[5:]}/raw/", recursive=True)
    for source in (str(src), f"{s3_bucket}/raw/"):
        with pytest.raises(SourceError) as err:
            shardkit.pack(source, f"{s3_bucket}/ds", storage_options=s3_server.storage_options(), progress=False)
        message = str(err.value)
        assert "\n" not in message and source.rstrip("/") in message and "a.tfrecord.gz, 2 in all" in message
        assert "gzip-compressed TFRecord" in message and "decompress them (gunzip)" in message
    assert not s3_server.filesystem().exists(f"{s3_bucket[5:]}/ds/dataset.json")


def test_bad_feature_names_refused(tmp_path):
    path = write_tfrecord(tmp_path / "n.tfrecord", [encode_example({"a/b": [b"1"], "a_b": [b"2"]})])
    with pytest.raises(SourceError, match="both make field 'a_b'"):
        shardkit.pack(str(path), str(tmp_path / "ds"), progress=False)


@pytest.mark.s3
def test_tfrecords_on_s3_equal_local(tmp_path, s3_server, s3_bucket):
    expected = make_tfrecords(tmp_path / "src")
    opts = s3_server.storage_options()
    fs = s3_server.filesystem()
    fs.put(str(tmp_path / "src") + "/", f"{s3_bucket[5:]}/raw/", recursive=True)
    src = TfRecordSource(f"{s3_bucket}/raw/", storage_options=opts)
    info = shardkit.pack(src, f"{s3_bucket}/ds", storage_options=opts, progress=False)
    assert info["num_samples"] == 10
    got, ds = _read_back(f"{s3_bucket}/ds", opts)
    assert got == expected
    assert ds.samples.column("source").to_pylist()[0] == "sub/train.tfrecord-00000-of-00002"
    # A glob URL resolves to the same source type; keys come from the file names then.
    glob = f"{s3_bucket}/raw/sub/*.tfrecord-*"
    assert isinstance(resolve_source(glob, storage_options=opts), TfRecordSource)
    shardkit.pack(glob, f"{s3_bucket}/ds2", storage_options=opts, progress=False)
    got2, _ = _read_back(f"{s3_bucket}/ds2", opts)
    assert got2 == {k[len("sub_"):]: v for k, v in expected.items()}


@pytest.mark.s3
@pytest.mark.parametrize("slash", ["/", ""])
def test_a_prefix_of_tfrecord_objects_packs_as_the_same_folder_on_disk(tmp_path, s3_server, s3_bucket, slash):
    """A bucket prefix holding only TFRecords is read as TFRecords, as the same folder on disk
    is: it used to pack as a keyed folder, each file one opaque sample (field ``tfrecord-...``)."""
    expected = make_tfrecords(tmp_path / "src")
    opts = s3_server.storage_options()
    s3_server.filesystem().put(str(tmp_path / "src") + "/", f"{s3_bucket[5:]}/raw/", recursive=True)
    assert isinstance(resolve_source(f"{s3_bucket}/raw{slash}", storage_options=opts), TfRecordSource)
    info = shardkit.pack(f"{s3_bucket}/raw{slash}", f"{s3_bucket}/ds", storage_options=opts, progress=False)
    local = shardkit.pack(str(tmp_path / "src"), str(tmp_path / "ds"), progress=False)
    assert info["num_samples"] == local["num_samples"] == 10 and info["fields"] == local["fields"]
    got, ds = _read_back(f"{s3_bucket}/ds", opts)
    assert got == expected
    assert ds.samples.to_pylist() == shardkit.open_dataset(str(tmp_path / "ds")).samples.to_pylist()


@pytest.mark.s3
@pytest.mark.ray
@pytest.mark.slow
def test_tfrecords_on_s3_ray_equals_local(tmp_path, ray_local, s3_env, s3_bucket):
    """TFRecords in S3, the endpoint in the driver's environment only (not the Ray workers'):
    the tasks read them from the endpoint the driver resolved."""
    from tests.pack.test_pack_ray import compare_datasets

    make_tfrecords(tmp_path / "src", files=3, per_file=4)
    s3_env.filesystem().put(str(tmp_path / "src") + "/", f"{s3_bucket[5:]}/raw/", recursive=True)
    glob = f"{s3_bucket}/raw/sub/*.tfrecord-*"
    kw = dict(progress=False, shard_samples=3, task_bytes=1)
    shardkit.pack(glob, f"{s3_bucket}/ray", engine="ray", **kw)
    shardkit.pack(glob, f"{s3_bucket}/local", engine="local", **kw)
    compare_datasets(f"{s3_bucket}/ray", f"{s3_bucket}/local")
    assert shardkit.open_dataset(f"{s3_bucket}/ray").num_samples == 12


def test_a_record_whose_length_starts_like_gzip_is_read(tmp_path):
    # Length 0x8b1f: its little-endian bytes begin 1f 8b, the gzip magic number.
    payload = encode_example({"x": [b"\x00" * (0x8B1F - 10)]})
    payload = encode_example({"x": [b"\x00" * (0x8B1F - 10 - (len(payload) - 0x8B1F))]})
    assert len(payload) == 0x8B1F
    path = write_tfrecord(tmp_path / "g.tfrecord", [payload])
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert [i.key for i in TfRecordSource(path).list_items()] == ["g-000000000"]


def test_sequence_example_refused_not_silently_cut():
    context = encode_example({"x": [b"1"]})  # field 1: the context Features, as in an Example
    feature_lists = len_field(2, len_field(1, len_field(1, b"frames") + len_field(2, b"")))
    with pytest.raises(SourceError, match="SequenceExample"):
        parse_example(context + feature_lists)
