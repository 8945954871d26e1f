"""One DDP rank for tests/datasets/test_token_stream.py: gloo process group, a TokenStream over
two token datasets read through StreamingDataLoader with workers.

argv[1] is a JSON config: urls, block_size, cache_dir, out (result JSON path), batch_size,
num_workers, stop_after (steps, optional), state_in (optional path). The result holds the
windows this rank received (as token lists), its steps, len(loader), and at ``stop_after`` the
loader's state.
"""

import json
import sys

import torch
import torch.distributed as dist

from shardkit import Stream, StreamingDataLoader, TokenStream


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    ts = TokenStream([Stream(u) for u in cfg["urls"]], block_size=cfg["block_size"], cache_dir=cfg["cache_dir"],
                     shuffle=True, seed=5, eos_token=0)
    loader = StreamingDataLoader(ts, batch_size=cfg["batch_size"], num_workers=cfg["num_workers"])
    if cfg.get("state_in"):
        with open(cfg["state_in"]) as f:
            loader.load_state_dict(json.load(f))
    out = {"rank": dist.get_rank(), "len": len(loader), "windows": [], "steps": 0}
    for batch in loader:
        out["windows"] += batch.tolist()
        out["steps"] += 1
        dist.all_reduce(torch.ones(1))  # as DDP's backward does: every rank's step waits for the others
        if cfg.get("stop_after") and out["steps"] == cfg["stop_after"]:
            out["state"] = loader.state_dict()
            break
    dist.barrier()
    with open(cfg["out"], "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
