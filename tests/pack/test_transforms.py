"""Pack-time image transforms, and ``--on-error skip|raise`` on bad images."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import shardkit
from shardkit.cli import main as cli_main
from shardkit.read.decode import npy_view
from shardkit.errors import ConfigError, SourceError
from shardkit.packing.sample import PackSample
from shardkit.packing.transforms import ImageTransform, transform_from_options


def _jpeg(arr: np.ndarray, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _photo(h: int = 120, w: int = 200) -> np.ndarray:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], axis=-1) + rng.integers(0, 20, (h, w, 3))
    return np.clip(arr, 0, 255).astype(np.uint8)


def _apply(t: ImageTransform, data: bytes, field: str = "jpg") -> PackSample:
    return t(PackSample("k", {field: data, "cls": b"1"}))


@pytest.mark.parametrize("fmt,ext,magic", [("jpeg", "jpg", b"\xff\xd8"), ("webp", "webp", b"RIFF")])
def test_reencode_quality(fmt, ext, magic):
    src = _jpeg(_photo(), quality=98)
    low = _apply(ImageTransform(reencode=f"{fmt}:30"), src).fields
    high = _apply(ImageTransform(reencode=f"{fmt}:95"), src).fields
    assert set(low) == {ext, "cls"} and low["cls"] == b"1"
    assert low[ext].startswith(magic) and high[ext].startswith(magic)
    assert len(low[ext]) < len(high[ext])
    assert Image.open(io.BytesIO(low[ext])).size == (200, 120)


def test_resize_shorter_side():
    out = _apply(ImageTransform(resize=60), _jpeg(_photo(120, 200))).fields
    assert Image.open(io.BytesIO(out["jpg"])).size == (100, 60)
    tall = _apply(ImageTransform(resize=50), _jpeg(_photo(200, 100))).fields
    assert Image.open(io.BytesIO(tall["jpg"])).size == (50, 100)


def test_bgr_to_rgb_swaps_channels():
    arr = np.zeros((32, 48, 3), np.uint8)
    arr[..., 0] = 200  # red in, blue out
    png = io.BytesIO()
    Image.fromarray(arr).save(png, "PNG")
    out = _apply(ImageTransform(bgr_to_rgb=True), png.getvalue(), "png").fields
    got = np.asarray(Image.open(io.BytesIO(out["png"])))  # lossless: exact
    assert (got[..., 2] == 200).all() and (got[..., 0] == 0).all()


def test_predecode_npy_hwc_uint8():
    arr = _photo(40, 64)
    png = io.BytesIO()
    Image.fromarray(arr).save(png, "PNG")
    out = _apply(ImageTransform(predecode=True), png.getvalue(), "png").fields
    assert set(out) == {"npy", "cls"}
    got = npy_view(out["npy"])
    assert got.dtype == np.uint8 and got.shape == (40, 64, 3)
    np.testing.assert_array_equal(got, arr)
    named = _apply(ImageTransform(predecode=True, resize=20), _jpeg(arr), "left.jpg").fields
    assert npy_view(named["left.npy"]).shape == (20, 32, 3)


def test_bad_options():
    with pytest.raises(ConfigError):
        ImageTransform(reencode="gif:3")
    with pytest.raises(ConfigError):
        ImageTransform(resize=0)
    with pytest.raises(ConfigError):
        ImageTransform(predecode=True, reencode="jpeg")
    assert transform_from_options() is None


def test_corrupt_image_raises_naming_it():
    with pytest.raises(SourceError, match="not a readable image"):
        _apply(ImageTransform(reencode="jpeg:80"), b"\xff\xd8 not a jpeg")


def _folder_with_corrupt(root: Path) -> Path:
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(4):
            (root / cls / f"{i}.jpg").write_bytes(_jpeg(_photo(24 + i, 30)))
    (root / "dog" / "2.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated garbage")
    return root


def test_on_error_skip_lists_the_bad_image(tmp_path, capsys):
    src = _folder_with_corrupt(tmp_path / "src")
    dest = tmp_path / "ds"
    rc = cli_main(["pack", str(src), str(dest), "--labels-from-dirs", "--reencode", "jpeg:80", "--on-error", "skip",
                   "--shard-samples", "3", "--json"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_samples"] == 7
    assert [s["ref"] for s in info["skipped"]] == ["dog/2.jpg"]
    assert "not a readable image" in info["skipped"][0]["reason"]
    ds = shardkit.open_dataset(str(dest))
    assert ds.info["skipped"] == info["skipped"]
    ds.verify(deep=True)
    assert len({s["__key__"] for s in ds.iter_samples()}) == 7


def test_on_error_raise_is_default_and_names_the_path(tmp_path, capsys):
    src = _folder_with_corrupt(tmp_path / "src")
    rc = cli_main(["pack", str(src), str(tmp_path / "ds"), "--labels-from-dirs", "--reencode", "jpeg:80", "--quiet"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "dog/2.jpg" in err and "not a readable image" in err
    assert err.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / "ds" / "dataset.json").exists()


def test_center_crop_batches_mixed_image_types_under_one_name(tmp_path):
    # ImageFolder of .jpg and .png: without as_field each keeps its own field (lists with None
    # gaps in a batch); with as_field every image lands in one [B, size, size, 3] array.
    from PIL import Image

    import shardkit

    src = tmp_path / "src"
    for cls in ("a", "b"):
        (src / cls).mkdir(parents=True)
        for i in range(3):
            img = Image.new("RGB", (40 + 10 * i, 60), (10 * i, 100, 200 if cls == "a" else 0))
            img.save(src / cls / f"{i}.{'jpg' if i % 2 else 'png'}")
    url = str(tmp_path / "ds")
    shardkit.pack(str(src), url, labels_from_dirs=True, progress=False)
    mixed = next(iter(shardkit.StreamingDataset(url, decode=shardkit.CenterCrop(32), batch_size=6)))
    assert isinstance(mixed["jpg"], list) and any(x is None for x in mixed["jpg"])
    assert any(x is None for x in mixed["png"])
    batch = next(iter(shardkit.StreamingDataset(url, decode=shardkit.CenterCrop(32, as_field="image"), batch_size=6)))
    assert "jpg" not in batch and "png" not in batch
    image = np.asarray(batch["image"])  # a tensor where torch is installed
    assert image.shape == (6, 32, 32, 3) and image.dtype == np.uint8
    assert sorted(np.asarray(batch["cls"]).tolist()) == [0, 0, 0, 1, 1, 1]
    assert (np.abs(image[:, 16, 16, 1].astype(int) - 100) <= 2).all()  # the middle pixel's green (JPEG: near)
