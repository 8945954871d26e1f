"""``shardkit`` command line: thin commands, each over one library call.

Exit codes: 0 success, 1 a failed check or operation, 2 bad usage. Errors are one line on
stderr naming the object at fault; ``--debug`` adds the traceback.

Each command imports what it runs when it runs, so ``shardkit --help`` and a command that
fails its argument checks stay quick (the library pulls in pyarrow, s3fs, PIL...).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import select
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

from shardkit.config import human_bytes, parse_size
from shardkit.errors import ConfigError, ShardkitError, SourceNotFoundError, first_line
from shardkit.storage.urls import redact_secrets

__all__ = ["build_parser", "main", "sample_rate"]

# Where `shardkit bench` says the benchmarks are when it cannot find them.
_BENCH_HINT = ("the benchmarks are not part of the installed package: they live in the repository's benchmarks/ "
               "(run `make bench`, or `shardkit bench` from the repository's root)")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _check_scheme(url: str, what: str) -> None:
    """ConfigError (exit 2, bad usage) for a URL whose scheme no fsspec filesystem has
    (``foo://x``), naming it as ``what``; storage would report it as a failed operation (exit 1)."""
    import fsspec
    from fsspec.core import split_protocol

    from shardkit.storage.urls import refuse_url_credentials

    refuse_url_credentials(url, what)  # before any message repeats the URL
    for part in url.split("::"):  # chained URLs: simplecache::s3://...
        protocol, _ = split_protocol(part)
        if protocol is None:
            continue
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError as exc:
            raise ConfigError(f"{what} {url}: unknown URL scheme {protocol!r} (no fsspec filesystem has it)") from exc
        except ImportError:
            pass  # a known scheme whose package is missing: storage says which one


def sample_rate(samples: int, seconds: float) -> str:
    """``samples`` over ``seconds`` for the pack summary, never rounded to zero.

    Whole samples/s when there are many, one decimal below 10, and seconds per sample below
    one a second (a few huge samples would otherwise read "0 samples/s").

    Args:
        samples: samples packed.
        seconds: the time it took.

    Returns:
        ``"1234 samples/s"``, ``"2.5 samples/s"`` or ``"2.9 s/sample"``.
    """
    rate = samples / max(seconds, 1e-9)
    if rate >= 10 or samples == 0:
        return f"{rate:.0f} samples/s"
    if rate >= 1:
        return f"{rate:.1f} samples/s"
    return f"{seconds / samples:.1f} s/sample"


def _ray_initialized() -> bool:
    """Whether Ray is imported and initialised in this process (never imports it)."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())


def _cmd_pack(args: argparse.Namespace) -> int:
    """``shardkit pack``: :func:`shardkit.packing.pack.pack`, then a summary (or ``--json``)."""
    from shardkit.packing.pack import pack
    from shardkit.packing.transforms import transform_from_options

    _check_scheme(args.source, "SOURCE")
    _check_scheme(args.dest, "DEST")
    shard_bytes = parse_size(args.shard_size, "--shard-size")  # the error names the option as typed
    transform = transform_from_options(reencode=args.reencode, resize=args.resize, bgr_to_rgb=args.bgr_to_rgb,
                                       predecode=args.predecode)
    # Ray prints its workers' and raylets' lines (a node that died, a worker started) to
    # sys.stdout from a thread, during the pack and after it: with --json, stdout holds the
    # JSON only, so those go to stderr and a Ray this command joined is left before printing.
    ray_before = _ray_initialized()
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        info = pack(args.source, args.dest, shard_bytes=shard_bytes, engine=args.engine,
                    shard_samples=args.shard_samples, labels_from_dirs=args.labels_from_dirs, on_error=args.on_error,
                    overwrite=args.overwrite, ray_address=args.ray_address, transform=transform,
                    hdf5_rows=args.hdf5_rows, zarr_rows=args.zarr_rows, lmdb_field=args.lmdb_field,
                    token_dtype=args.token_dtype, token_column=args.token_column,
                    progress=not (args.json or args.quiet), append=args.append, payload_columns=args.payload_columns)
        if args.json and not ray_before and _ray_initialized():
            sys.modules["ray"].shutdown()
    if args.json:
        _print_json(info)
    elif info.get("up_to_date"):
        print(f"up to date: {args.dest} version {info.get('dataset_version', 1)} was packed from this source with these "
              "options; nothing written")
    else:
        rate = info["total_bytes"] / max(info["elapsed_seconds"], 1e-9) / 1e6
        print(f"packed {info['num_samples']} samples into {info['num_shards']} shards "
              f"({human_bytes(info['total_bytes'])}) at {args.dest} in {info['elapsed_seconds']:.1f}s "
              f"({rate:.1f} MB/s, {sample_rate(info['num_samples'], info['elapsed_seconds'])})")
        if info["reused_tasks"]:
            print(f"resumed: {info['reused_tasks']} of {info['tasks']} tasks were already complete")
        if info.get("nodes"):
            per_node = ", ".join(f"{node[:8]} ({n} tasks)" for node, n in info["nodes"].items())
            print(f"ran on {len(info['nodes'])} Ray node{'s' if len(info['nodes']) != 1 else ''}: {per_node}")
        if info["skipped"]:
            print(f"skipped {len(info['skipped'])} bad inputs (listed in dataset.json):")
            for s in info["skipped"][:10]:
                # Most reasons name their input already ('file list L: row 3: ...'): not twice.
                print(f"  {s['reason']}" if s["ref"] in s["reason"] else f"  {s['ref']}: {s['reason']}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    """``shardkit info``: :func:`shardkit.read.dataset.open_dataset`, summarised (or ``--json``)."""
    from shardkit.read.dataset import open_dataset

    from shardkit.read.versions import version_infos

    _check_scheme(args.dest, "DEST")
    ds = open_dataset(args.dest)
    info = dict(ds.info)
    versions = version_infos(ds.store) if ds.version > 1 else []
    if args.where is not None:
        info["selected"] = _selected(ds, args.where)
    if args.json:
        if versions:  # a dataset never appended to prints its dataset.json unchanged
            info["versions"] = [vars(v) for v in versions]
        _print_json(info)
        return 0
    print(f"dataset   {ds.url}")
    print(f"samples   {ds.num_samples}")
    print(f"shards    {ds.num_shards}")
    print(f"bytes     {human_bytes(info['total_bytes'])}")
    print(f"fields    {', '.join(ds.fields)}")
    if versions:
        print(f"versions  {len(versions)} (latest {ds.version}):")
        for v in versions:
            print(f"  v{v.version}  {v.num_samples} samples  {v.num_shards} shards  {human_bytes(v.total_bytes)}  "
                  f"committed {v.created}")
    if ds.labels:
        shown = ", ".join(f"{k}={v}" for k, v in list(ds.labels.items())[:20])
        print(f"labels    {len(ds.labels)}: {shown}{' ...' if len(ds.labels) > 20 else ''}")
    print(f"created   {info.get('created')} (shardkit {info.get('shardkit_version')})")
    if info.get("skipped"):
        if "index" in info:  # index lists a tar, not a member, per entry
            print(f"skipped   {info['index'].get('skipped_members')} tar members (in {len(info['skipped'])} tars) "
                  "that the webdataset library skips too")
        else:
            print(f"skipped   {len(info['skipped'])} inputs at pack time")
    if "selected" in info:
        sel = info["selected"]
        print(f"selected  {sel['num_samples']} of {ds.num_samples} samples ({human_bytes(sel['bytes'])}) "
              f"where {sel['where']}")
    return 0


def _selected(ds: Any, where: str) -> dict[str, Any]:
    """``info --where``: the count and bytes of the samples the query selects."""
    from shardkit.read.cache_refs import cache_namespace
    from shardkit.read.manifest_copies import manifest_copies_dir
    from shardkit.read.where import where_count

    ds.manifest_cache = manifest_copies_dir(cache_namespace(ds))  # a second query reads local copies
    count, size = where_count(ds, where)
    return {"where": where, "num_samples": count, "bytes": size}


def _cmd_annotate(args: argparse.Namespace) -> int:
    """``shardkit annotate``: :func:`shardkit.packing.annotate.annotate`, then a summary (or ``--json``)."""
    from shardkit.packing.annotate import annotate

    _check_scheme(args.dest, "DEST")
    out = annotate(args.dest, args.table, on=args.on, name=args.name, overwrite=args.overwrite)
    if args.json:
        _print_json(out)
    else:
        print(f"annotated {out['rows']} samples with {', '.join(out['columns'])} at {out['path']}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    """``shardkit verify``: :meth:`shardkit.read.dataset.Dataset.verify`; exit 1 on a fault."""
    from shardkit.errors import IntegrityError
    from shardkit.packing.progress import Progress
    from shardkit.read.dataset import Dataset

    _check_scheme(args.dest, "DEST")
    try:
        # Not strict: a dataset.json that disagrees with the manifest is one of the faults listed.
        ds = Dataset(args.dest, strict=False)
        total = sum(s.bytes for s in ds.shard_list)
        with Progress(None, total, 1, "verify", enabled=not (args.json or args.quiet)) as bar:
            report = ds.verify(deep=args.deep, progress=lambda n: bar.advance(0, n))
    except ShardkitError as exc:
        if args.json:  # a machine reading --json gets its answer whatever failed
            _print_json({"ok": False, "error": str(exc), "failures": getattr(exc, "failures", [str(exc)])})
        if not isinstance(exc, IntegrityError):
            raise  # main() says it in one line, with its exit code
        print(f"shardkit: verify failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        _print_json(report)
    else:
        print(f"ok: {report['shards_checked']} shards, {ds.num_samples} samples"
              f"{' (checksums verified)' if args.deep else ' (sizes verified; --deep checks checksums)'}")
    return 0


def _cmd_index(args: argparse.Namespace) -> int:
    """``shardkit index``: :func:`shardkit.packing.index.index_tars`, then a summary (or ``--json``)."""
    from shardkit.packing.index import index_tars

    _check_scheme(args.dest, "DEST")
    info = index_tars(args.dest, overwrite=args.overwrite, progress=not (args.json or args.quiet))
    if args.json:
        _print_json(info)
    else:
        print(f"indexed {info['num_samples']} samples in {info['num_shards']} shards at {args.dest}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """``shardkit bench``: ``benchmarks.run`` of the repository (not installed with the package)."""
    run = _benchmarks().main
    return int(run(args.bench_args, prog="shardkit bench") or 0)


def _benchmarks() -> ModuleType:
    """``benchmarks.run`` from the repository's ``benchmarks/``: the checkout this package runs
    from (a source tree, an editable install) or else the current directory. It is loaded from
    there without putting the checkout on ``sys.path``: its other folders stay out of reach.

    Raises:
        ConfigError: no checkout is reachable, or the benchmarks' own imports fail.
    """
    if "benchmarks" not in sys.modules:
        folder = next((d / "benchmarks" for d in (Path(__file__).resolve().parent.parent, Path.cwd())
                       if (d / "benchmarks" / "run.py").is_file()), None)
        spec = None if folder is None else importlib.util.spec_from_file_location(
            "benchmarks", folder / "__init__.py", submodule_search_locations=[str(folder)])
        if spec is None or spec.loader is None:
            raise ConfigError(_BENCH_HINT)
        sys.modules["benchmarks"] = package = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(package)
    try:
        return importlib.import_module("benchmarks.run")
    except ImportError as exc:
        raise ConfigError(f"the benchmarks need packages that are missing ({first_line(exc)}): "
                          "pip install -e '.[bench]' in the repository, or run `make bench`") from exc


def build_parser() -> argparse.ArgumentParser:
    """The ``shardkit`` argument parser, one subcommand per command.

    Returns:
        The parser; a parsed namespace's ``func`` runs its command.
    """
    p = argparse.ArgumentParser(prog="shardkit", description="Sharded WebDataset storage on object storage.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True)

    pk = sub.add_parser("pack", help="pack a source into a dataset")
    pk.add_argument("source", help="folder, ImageFolder, CSV/Parquet list, .h5, .npy/.npz, WebDataset .tar(s), "
                                    "Zarr store, LMDB environment, .tfrecord(s), Parquet/Arrow table")
    pk.add_argument("dest", help="dataset URL: s3://bucket/prefix, a local path, ...")
    pk.add_argument("--shard-size", default="512MB", help="target shard size (default 512MB)")
    pk.add_argument("--shard-samples", type=int, default=None, help="also close a shard at this many samples")
    pk.add_argument("--engine", choices=["local", "ray"], default="local")
    pk.add_argument("--ray-address", default=None, help="Ray cluster address (default: local Ray)")
    pk.add_argument("--labels-from-dirs", action="store_true", help="ImageFolder: class folders -> cls field")
    pk.add_argument("--hdf5-rows", default=None, metavar="DATASETS",
                    help="HDF5: rows of these datasets (comma separated) are samples")
    pk.add_argument("--zarr-rows", default=None, metavar="ARRAYS",
                    help="Zarr: rows of these arrays (comma separated) are samples")
    pk.add_argument("--lmdb-field", default=None, metavar="FIELD",
                    help="LMDB: the field each value is packed as, e.g. jpg (default bin)")
    pk.add_argument("--payload-columns", default=None, metavar="COL:FIELD,...",
                    help="Parquet/Arrow table: binary column -> field (img:jpg,depth:npy)")
    pk.add_argument("--token-dtype", choices=["uint16", "uint32"], default=None,
                    help="tokenized documents (.npy/.bin token arrays, Parquet token lists): the dtype stored "
                         "(needed for raw .bin files)")
    pk.add_argument("--token-column", default=None, metavar="COLUMN",
                    help="tokenized documents: the Parquet column holding each row's token list")
    pk.add_argument("--on-error", choices=["raise", "skip"], default="raise")
    pk.add_argument("--reencode", default=None, metavar="FMT[:QUALITY]", help="re-encode images: jpeg:90, webp:80")
    pk.add_argument("--resize", type=int, default=None, metavar="SHORTER_SIDE", help="resize images (shorter side)")
    pk.add_argument("--bgr-to-rgb", action="store_true", help="swap channels of 3-channel images")
    pk.add_argument("--predecode", action="store_true", help="store images decoded as uint8 .npy")
    pk.add_argument("--overwrite", action="store_true",
                    help="replace an existing dataset at DEST; the old one is removed when the pack starts (after "
                         "options, source and plan are checked), so a pack that fails leaves none; to keep it "
                         "readable until the new one is done, pack to a new prefix and switch to it")
    pk.add_argument("--append", action="store_true",
                    help="add the source to the dataset at DEST as a new version (keys must be new)")
    pk.add_argument("--json", action="store_true")
    pk.add_argument("--quiet", action="store_true", help="no progress bar")
    pk.set_defaults(func=_cmd_pack)

    inf = sub.add_parser("info", help="summary of a dataset")
    inf.add_argument("dest")
    inf.add_argument("--json", action="store_true")
    inf.add_argument("--where", help="also count the samples (and bytes) this SQL condition over the manifest "
                                     "selects, e.g. \"label < 500\" (needs shardkit[query])")
    inf.set_defaults(func=_cmd_info)

    vf = sub.add_parser("verify", help="check shards against the manifest")
    vf.add_argument("dest")
    vf.add_argument("--deep", action="store_true", help="verify every checksum (reads all data)")
    vf.add_argument("--json", action="store_true")
    vf.add_argument("--quiet", action="store_true")
    vf.set_defaults(func=_cmd_verify)

    ix = sub.add_parser("index", help="build a manifest for existing WebDataset tars in place")
    ix.add_argument("dest", help="directory or prefix holding *.tar shards (subfolders too)")
    ix.add_argument("--overwrite", action="store_true",
                    help="replace an existing dataset.json and manifest/ (the tars are kept)")
    ix.add_argument("--json", action="store_true")
    ix.add_argument("--quiet", action="store_true")
    ix.set_defaults(func=_cmd_index)

    an = sub.add_parser("annotate", help="add a Parquet table's columns to a dataset's manifest (side columns)")
    an.add_argument("dest")
    an.add_argument("table", help="a Parquet file: a column to join on and the columns to add")
    an.add_argument("--on", default="key", help="the column joining table rows to samples (default: key)")
    an.add_argument("--name", help="the annotation's name (default: the table file's stem)")
    an.add_argument("--overwrite", action="store_true", help="replace an annotation of the same name")
    an.add_argument("--json", action="store_true")
    an.set_defaults(func=_cmd_annotate)

    # No -h of its own: every argument, -h included, goes through to benchmarks.run.
    bn = sub.add_parser("bench", help="throughput side by side with baselines (see benchmarks/)", add_help=False)
    bn.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of python -m benchmarks.run")
    bn.set_defaults(func=_cmd_bench)
    return p


# Options whose value may look like an option: argparse takes "-5MB" for one and said only
# "expected one argument"; joined as "--shard-size=-5MB", the value reaches parse_size, which
# says it must be positive.
_VALUE_OPTIONS = ("--shard-size",)


def _join_dashed_values(argv: list[str]) -> list[str]:
    """``argv`` with a dashed value joined to its option (``--shard-size=-5MB``)."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in _VALUE_OPTIONS and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _split_bench(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(shardkit's own args, benchmarks.run's args or None).

    argparse's REMAINDER does not capture a leading option (``bench --quick``), so everything
    after ``bench`` is cut off before parsing. The global options take no value, so the first
    token without a dash is the command.
    """
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return (argv[: i + 1], argv[i + 1 :]) if arg == "bench" else (argv, None)
    return argv, None


# Libraries that log requests at DEBUG: botocore prints the signed headers (the access key id
# in Authorization, the whole x-amz-security-token), s3fs every call's arguments (SSE keys
# included), urllib3/aiohttp full URLs. Secrets never appear in logs, so --debug leaves them
# at WARNING; it is for shardkit's own debug logs and tracebacks.
_REQUEST_LOGGERS = ("botocore", "boto3", "s3transfer", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp",
                    "gcsfs", "google", "adlfs", "azure")


def _configure_logging(debug: bool) -> None:
    """WARNING and up from everything; with ``debug``, also shardkit's own DEBUG records."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("shardkit").setLevel(logging.DEBUG if debug else logging.NOTSET)
    # Pinned, not just inherited from the root: a root logger set to DEBUG later (a Ray
    # worker's setup, a user's basicConfig(force=True)) must not turn them on.
    for name in _REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _stdout_gone() -> bool:
    """True when stdout is a pipe nobody reads any more (a broken pipe elsewhere, a storage
    connection say, is an error to report)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):  # no stdout, or one without a descriptor
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``shardkit`` command.

    Args:
        argv: the arguments after ``shardkit`` (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 success, 1 a failed check or operation, 2 bad usage (a bad option or
        URL, a missing source), 130 interrupted, 141 when the reader of stdout went away.

    Raises:
        ShardkitError: with ``--debug`` only, the command's error (else it is printed as one
            line on stderr and becomes the exit code).
        SystemExit: argparse's, for unknown options and ``--help``.
    """
    parser = build_parser()
    own, bench_args = _split_bench(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(_join_dashed_values(own))
    if bench_args is not None:
        args.bench_args = bench_args
    _configure_logging(args.debug)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in Python's flush at exit
        return code
    except (ConfigError, SourceNotFoundError) as exc:
        if args.debug:
            raise
        print(f"shardkit: error: {redact_secrets(str(exc))}", file=sys.stderr)
        return 2
    except ShardkitError as exc:
        if args.debug:
            raise
        print(f"shardkit: error: {redact_secrets(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardkit: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the contract: one line on stderr, a traceback only with --debug
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            # The reader went away (`shardkit info URL | head -1`): stop quietly as cat or grep
            # do, with their status (killed by SIGPIPE). Python's flush at exit would fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        if args.debug:
            raise
        print(f"shardkit: error: {type(exc).__name__}: {redact_secrets(first_line(exc))} (--debug shows where)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
