"""One DDP rank for tests/datasets/test_mix_stream.py: gloo process group, a mixture of streams
read through StreamingDataLoader with workers.

argv[1] is a JSON config: urls, weights, wheres (optional, a where= per stream or null), epoch_size, cache_dir, out (result JSON path),
batch_size, num_workers, drop_last, stop_after (steps, optional), state_in (optional path).
The result holds the (stream, key) pairs this rank received, its steps, len(loader), and at
``stop_after`` the loader's state.
"""

import torch.distributed as dist

from ddp_common import finish, resume, run_steps, start
from shardkit import Stream, StreamingDataLoader, StreamingDataset


def main() -> None:
    cfg = start()
    wheres = cfg.get("wheres") or [None] * len(cfg["urls"])
    streams = [Stream(u, weight=w, where=q) for u, w, q in zip(cfg["urls"], cfg["weights"], wheres)]
    ds = StreamingDataset(streams, cache_dir=cfg["cache_dir"], shuffle=True, seed=11, batch_size=cfg["batch_size"],
                          drop_last=cfg.get("drop_last", False), epoch_size=cfg.get("epoch_size"))
    loader = StreamingDataLoader(ds, num_workers=cfg["num_workers"])
    resume(loader, cfg)
    out = {"rank": dist.get_rank(), "len": len(loader), "pairs": [], "steps": 0}

    def take(batch: dict) -> None:
        out["pairs"] += [[s, k] for s, k in zip(batch["__stream__"].tolist(), batch["__key__"])]

    run_steps(loader, cfg, out, take)
    dist.barrier()
    out["stats"] = ds.stats()
    finish(cfg, out)


if __name__ == "__main__":
    main()
