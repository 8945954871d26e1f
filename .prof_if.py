import time, sys, io
from pathlib import Path
sys.path.insert(0, "tests/pack")
from test_sources_remote import _imagefolder, _upload
from shardkit.dev.devserver import DevServer
import shardkit, tempfile
with DevServer(key_prefix="sk") as s3:
    so = s3.storage_options(); fs = s3.filesystem(); fs.mkdir("bkt-prof")
    tmp = Path(tempfile.mkdtemp())
    t=time.time(); _imagefolder(tmp/"train", 8, 250); print("make", time.time()-t)
    t=time.time(); _upload(s3, tmp/"train", "s3://bkt-prof/raw/train"); print("upload", time.time()-t)
    t=time.time(); shardkit.pack(str(tmp/"train"), "s3://bkt-prof/d1", labels_from_dirs=True, shard_bytes="200KB", storage_options=so, progress=False); print("pack local", time.time()-t)
    from shardkit.packing.sources.imagefolder import ImageFolderSource
    t=time.time(); n=len(ImageFolderSource("s3://bkt-prof/raw/train", so).list_items()); print("list", n, time.time()-t)
    t=time.time(); shardkit.pack("s3://bkt-prof/raw/train/", "s3://bkt-prof/d2", labels_from_dirs=True, shard_bytes="200KB", storage_options=so, progress=False); print("pack remote", time.time()-t)
