"""Hugging Face datasets.Dataset (HfSource) and IterableDataset as pack sources."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys

import numpy as np
import pytest

import shardkit
from shardkit.errors import SourceError
from shardkit.packing.sources.hf import HfSource, hf_kind

datasets = pytest.importorskip("datasets")

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(100))
JPG = b"\xff\xd8\xff\xe0" + bytes(range(100, 200))


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def make_dataset(n: int = 6):
    features = datasets.Features({
        "image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "eel"]),
        "caption": datasets.Value("string"), "emb": datasets.Sequence(datasets.Value("float32")),
        "mask": datasets.Array2D((2, 3), "uint8"), "year": datasets.Value("int32")})
    rng = np.random.default_rng(0)
    rows = {"image": [{"bytes": (PNG if i % 2 else JPG) + bytes([i]), "path": None} for i in range(n)],
            "label": [i % 3 for i in range(n)], "caption": [f"caption {i}" for i in range(n)],
            "emb": [rng.standard_normal(3).astype(np.float32).tolist() for _ in range(n)],
            "mask": [np.full((2, 3), i, np.uint8).tolist() for i in range(n)], "year": [2000 + i for i in range(n)]}
    return datasets.Dataset.from_dict(rows, features=features), rows


def expected(rows: dict, n: int) -> dict[str, dict[str, bytes]]:
    out = {}
    for i in range(n):
        img = rows["image"][i]["bytes"]
        out[f"{i:09d}"] = {f"image.{'png' if i % 2 else 'jpg'}": img, "cls": str(i % 3).encode(),
                           "caption.txt": f"caption {i}".encode(), "emb.npy": npy(np.array(rows["emb"][i], np.float32)),
                           "mask.npy": npy(np.full((2, 3), i, np.uint8))}
    return out


def read_back(url: str):
    ds = shardkit.open_dataset(url)
    return {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")} for s in ds.iter_samples()}, ds


def test_dataset_round_trip_exact(tmp_path):
    hf, rows = make_dataset()
    assert hf_kind(hf) == "Dataset" and hf_kind(rows) is None
    info = shardkit.pack(hf, str(tmp_path / "ds"), progress=False, shard_samples=4)
    assert info["num_samples"] == 6 and info["source"]["type"] == "hf"
    assert info["labels"] == {"cat": 0, "dog": 1, "eel": 2}
    got, ds = read_back(str(tmp_path / "ds"))
    assert got == expected(rows, 6)  # image bytes as stored: no decode, no re-encode
    assert ds.samples.column("year").to_pylist() == [2000 + i for i in range(6)]
    mask = np.load(io.BytesIO(got["000000004"]["mask.npy"]))
    assert mask.dtype == np.uint8 and mask.shape == (2, 3)


def test_selected_rows_and_pickled_source_load_the_same(tmp_path):
    hf, rows = make_dataset()
    src = HfSource(hf.select([5, 1, 3]))  # an indices mapping over the table
    items = src.list_items()
    again = pickle.loads(pickle.dumps(src))  # as a Ray task receives it
    for item, want in zip(items, (5, 1, 3)):
        a, b = src.load(item), again.load(item)
        assert a.fields == b.fields and a.meta == b.meta
        assert a.fields["cls"] == str(want % 3).encode() and a.meta["year"] == 2000 + want


@pytest.mark.slow  # datasets' to_iterable_dataset imports torch (seconds, once per process)
def test_iterable_dataset_packs_like_the_dataset(tmp_path):
    hf, rows = make_dataset()
    info = shardkit.pack(hf.to_iterable_dataset(), str(tmp_path / "it"), progress=False)
    assert info["num_samples"] == 6 and info["source"]["type"] == "iterable"
    got, ds = read_back(str(tmp_path / "it"))
    assert got == expected(rows, 6)
    assert ds.samples.column("year").to_pylist() == [2000 + i for i in range(6)]


def test_image_from_path_and_key_column(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    hf = datasets.Dataset.from_dict({"__key__": ["k1"], "image": [{"bytes": None, "path": str(tmp_path / "a.png")}]},
                                    features=datasets.Features({"__key__": datasets.Value("string"),
                                                                "image": datasets.Image()}))
    shardkit.pack(hf, str(tmp_path / "ds"), progress=False)
    got, _ = read_back(str(tmp_path / "ds"))
    assert got == {"k1": {"image.png": PNG}}


def test_missing_datasets_package_hint(monkeypatch):
    hf, _ = make_dataset(1)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(SourceError) as err:
        HfSource(hf)
    assert str(err.value) == "HfSource needs datasets: pip install 'shardkit[hf]'"


@pytest.mark.slow  # a fresh interpreter
def test_datasets_not_imported_for_other_sources(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"x")
    code = ("import sys, shardkit; shardkit.pack(sys.argv[1], sys.argv[2], progress=False); "
            "print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "src"), str(tmp_path / "ds")],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
