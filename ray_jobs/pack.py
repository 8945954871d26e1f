"""Ray job entry point: ``shardkit pack`` with the Ray engine by default.

Submit it to a cluster::

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python ray_jobs/pack.py SRC s3://bucket/ds [--shard-size 512MB] [...]

It takes exactly the arguments of ``shardkit pack`` (see ``shardkit pack --help``); only the
engine defaults to ``ray``. The driver joins the job's cluster through ``RAY_ADDRESS``, which
``ray job submit`` sets. S3 settings come from the usual ``AWS_*`` variables. The tasks write
to the endpoint and region the driver resolved (they travel with each task); the keys never
do: pass them with ``--runtime-env-json '{"env_vars": {...}}'`` or configure them on the
cluster's nodes.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

# Run from a checkout (``--working-dir .``) without an installed package: the repository
# root is this file's parent's parent.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_REPO, "shardkit")) and _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from shardkit.cli import main as cli_main  # noqa: E402

__all__ = ["main", "with_ray_engine"]


def with_ray_engine(argv: Sequence[str]) -> list[str]:
    """The ``shardkit`` arguments for a pack with these arguments, on Ray unless told otherwise.

    Args:
        argv: ``shardkit pack`` arguments (``--debug`` may be among them).

    Returns:
        ``[--debug] pack [--engine ray] ...``: ``--engine ray`` added unless an engine was given.
    """
    args = list(argv)
    # --debug belongs to the top-level parser, in front of the subcommand.
    top = ["--debug"] if "--debug" in args else []
    args = [a for a in args if a != "--debug"]
    given = any(a == "--engine" or a.startswith("--engine=") for a in args)
    return [*top, "pack", *args] if given else [*top, "pack", "--engine", "ray", *args]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``shardkit pack`` with the Ray engine by default.

    Args:
        argv: ``shardkit pack`` arguments (default: ``sys.argv[1:]``).

    Returns:
        The CLI's exit code.
    """
    return cli_main(with_ray_engine(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
