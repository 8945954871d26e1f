"""One DDP rank for tests/test_ddp.py: gloo process group, StreamingDataLoader with workers.

argv[1] is a JSON config: url, cache_dir, out (result JSON path), epochs, batch_size,
num_workers, cache_limit, shuffle, stop_after (steps, optional), state_in (optional path),
decode ("crop": CenterCrop of the jpg field, optional), all_reduce (one per step, as DDP's
backward does, optional).
"""

import torch
import torch.distributed as dist

from ddp_common import finish, resume, start
from shardkit import CenterCrop, StreamingDataLoader, StreamingDataset


def main() -> None:
    cfg = start()
    ds = StreamingDataset(cfg["url"], cache_dir=cfg["cache_dir"], cache_limit=cfg.get("cache_limit", "10GB"),
                          shuffle=cfg.get("shuffle", True), seed=11, batch_size=cfg["batch_size"],
                          shuffle_block=cfg.get("shuffle_block", 4),
                          decode=CenterCrop(32, as_field="jpg") if cfg.get("decode") == "crop" else None)
    loader = StreamingDataLoader(ds, num_workers=cfg["num_workers"], persistent_workers=cfg["num_workers"] > 0)
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "epochs": [], "len": len(loader)}
    resume(loader, cfg)
    for epoch in range(cfg.get("first_epoch", 0), cfg.get("first_epoch", 0) + cfg["epochs"]):
        ds.set_epoch(epoch)
        keys, steps = [], 0
        for batch in loader:
            keys += batch["__key__"]
            steps += 1
            if cfg.get("all_reduce"):  # waits for every rank's step: a rank stuck reading stalls all
                dist.all_reduce(torch.ones(1))
            if cfg.get("stop_after") and steps == cfg["stop_after"]:
                out["state"] = loader.state_dict()
                break
        out["epochs"].append({"keys": keys, "steps": steps})
        dist.barrier()
    out["stats"] = ds.stats()
    finish(cfg, out)


if __name__ == "__main__":
    main()
