"""One DDP rank for tests/datasets/test_mix_stream.py: gloo process group, a mixture of streams
read through StreamingDataLoader with workers.

argv[1] is a JSON config: urls, weights, wheres (optional, a where= per stream or null), epoch_size, cache_dir, out (result JSON path),
batch_size, num_workers, drop_last, stop_after (steps, optional), state_in (optional path).
The result holds the (stream, key) pairs this rank received, its steps, len(loader), and at
``stop_after`` the loader's state.
"""

import json
import sys

import torch
import torch.distributed as dist

from shardkit import Stream, StreamingDataLoader, StreamingDataset


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    wheres = cfg.get("wheres") or [None] * len(cfg["urls"])
    streams = [Stream(u, weight=w, where=q) for u, w, q in zip(cfg["urls"], cfg["weights"], wheres)]
    ds = StreamingDataset(streams, cache_dir=cfg["cache_dir"], shuffle=True, seed=11, batch_size=cfg["batch_size"],
                          drop_last=cfg.get("drop_last", False), epoch_size=cfg.get("epoch_size"))
    loader = StreamingDataLoader(ds, num_workers=cfg["num_workers"])
    if cfg.get("state_in"):
        with open(cfg["state_in"]) as f:
            loader.load_state_dict(json.load(f))
    out = {"rank": dist.get_rank(), "len": len(loader), "pairs": [], "steps": 0}
    for batch in loader:
        out["pairs"] += [[s, k] for s, k in zip(batch["__stream__"].tolist(), batch["__key__"])]
        out["steps"] += 1
        dist.all_reduce(torch.ones(1))  # as DDP's backward does: every rank's step waits for the others
        if cfg.get("stop_after") and out["steps"] == cfg["stop_after"]:
            out["state"] = loader.state_dict()
            break
    dist.barrier()
    out["stats"] = ds.stats()
    with open(cfg["out"], "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
