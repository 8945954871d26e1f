"""DDP launched the torch.multiprocessing way, for tests/test_ddp.py: ``mp.spawn`` ranks that call
``init_process_group("gloo", rank=r, world_size=w)`` with no RANK/WORLD_SIZE in the environment,
each reading through DataLoader workers that are not forked (so torch.distributed is not
initialised in them).

argv[1] is a JSON config: url, cache_dir, out (a directory), port. Each rank writes
``r<rank>.json``: per reader, the keys it yielded and len(loader).
"""

import json
import os
import sys
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
import webdataset as wds
from torch.utils.data import DataLoader

from shardkit import StreamingDataLoader, StreamingDataset, wds_shards

WORLD = 2


def run(rank: int, cfg: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    out: dict[str, Any] = {}
    ds = StreamingDataset(cfg["url"], cache_dir=cfg["cache_dir"], shuffle=True, batch_size=8)
    loader = StreamingDataLoader(ds, num_workers=2, multiprocessing_context="spawn")
    out["loader"] = {"keys": [k for b in loader for k in b["__key__"]], "len": len(loader)}
    plain = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    out["plain"] = {"keys": [k for b in plain for k in b["__key__"]], "len": len(ds)}
    stage = wds_shards(cfg["url"], cache_dir=cfg["cache_dir"], shuffle=True)
    pipe = wds.DataPipeline(stage, wds.tarfile_to_samples())
    wl = DataLoader(pipe, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    out["wds"] = {"keys": [s["__key__"] for s in wl], "shards": stage.shards()}
    with open(os.path.join(cfg["out"], f"r{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(json.loads(sys.argv[1]),), nprocs=WORLD)
