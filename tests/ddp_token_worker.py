"""One DDP rank for tests/datasets/test_token_stream.py: gloo process group, a TokenStream over
two token datasets read through StreamingDataLoader with workers.

argv[1] is a JSON config: urls, block_size, cache_dir, out (result JSON path), batch_size,
num_workers, stop_after (steps, optional), state_in (optional path). The result holds the
windows this rank received (as token lists), its steps, len(loader), and at ``stop_after`` the
loader's state.
"""

import torch
import torch.distributed as dist

from ddp_common import finish, resume, run_steps, start
from shardkit import Stream, StreamingDataLoader, TokenStream


def main() -> None:
    cfg = start()
    ts = TokenStream([Stream(u) for u in cfg["urls"]], block_size=cfg["block_size"], cache_dir=cfg["cache_dir"],
                     shuffle=True, seed=5, eos_token=0)
    loader = StreamingDataLoader(ts, batch_size=cfg["batch_size"], num_workers=cfg["num_workers"])
    resume(loader, cfg)
    out = {"rank": dist.get_rank(), "len": len(loader), "windows": [], "steps": 0}

    def take(batch: torch.Tensor) -> None:
        out["windows"] += batch.tolist()

    run_steps(loader, cfg, out, take)
    dist.barrier()
    finish(cfg, out)


if __name__ == "__main__":
    main()
