"""Listing the objects under a URL prefix in sorted order, many prefixes at once.

A bucket of 20 M objects listed by one client paging 1,000 keys at a time takes hours before
anything starts. This walk lists one level at a time with a delimiter (a "directory" per
call), and lists up to :data:`LIST_AHEAD` directories at once on a thread pool, ahead of the
one being consumed: the class folders of an ImageFolder list in parallel. It yields in exactly
the order :func:`~shardkit.packing.sources.walk.walk_in_order` yields a local folder's files,
so a folder packs to the same bytes from disk or from a bucket.

Memory: only the listings of the directories read ahead are held (each freed as it is
consumed), and fsspec's listings cache is emptied after every call. A single directory of
millions of objects still lists as one paged call (no prefix to split it by).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

from shardkit.errors import SourceNotFoundError
from shardkit.packing.sources.objects import Objects, join_url

__all__ = ["LIST_AHEAD", "LIST_THREADS", "list_dir", "walk_objects"]

#: List calls in flight at once.
LIST_THREADS = 16
#: Directories listed ahead of the one being consumed (bounds what is held).
LIST_AHEAD = 64

# One directory: its kept entries sorted descending (popped from the end in ascending order):
# (sort text, size) for a file, (name + "/", -1) for a subdirectory.
_Listing = list[tuple[str, int]]


def list_dir(objects: Objects, url: str) -> tuple[list[tuple[str, int]], list[str]]:
    """One level of ``url``: its files' (name, size) and its subdirectories' names, hidden
    names (``.x``) left out.

    Args:
        objects: the reader of the source's storage.
        url: a folder URL.

    Returns:
        (files, directories), in the store's order.

    Raises:
        SourceNotFoundError: nothing is under ``url``.
        SourceError: the listing failed.
    """
    def ls(fs: Any, path: str) -> list[dict[str, Any]]:
        try:
            return list(fs.ls(path, detail=True, refresh=True))
        finally:
            fs.invalidate_cache(path)  # s3fs would keep every listing: 20 M dicts

    entries = objects.call(url, ls)
    files: list[tuple[str, int]] = []
    dirs: list[str] = []
    prefix = objects.locate(url)[0].fs._strip_protocol(url).rstrip("/")
    for e in entries:
        name = str(e["name"]).rstrip("/")
        if name == prefix:
            continue  # a folder's own placeholder object ("train/")
        base = name.rpartition("/")[2]
        if not base or base.startswith("."):
            continue
        if e.get("type") == "directory":
            dirs.append(base)
        else:
            files.append((base, int(e.get("size") or 0)))
    if not files and not dirs:
        raise SourceNotFoundError(f"source {url}: no objects under this prefix")
    return files, dirs


def walk_objects(objects: Objects, root: str, entry: Callable[[str], str | None],
                 rejected: list[str] | None = None, tops: Sequence[str] | None = None,
                 threads: int | None = None, ahead: int = LIST_AHEAD) -> Iterator[tuple[str, int]]:
    """(relative posix path, size) of the objects under ``root`` that ``entry`` keeps, in the
    order :func:`~shardkit.packing.sources.walk.walk_in_order` gives a local folder, streamed.

    ``entry(name)`` is the text a kept name sorts by within its directory, or None to leave
    it out (its relative path goes to ``rejected``). Directories are listed in depth-first
    order on ``threads`` threads, at most ``ahead`` of them beyond the one being consumed.
    With ``tops`` (an ImageFolder's class folders), only those folders are walked, one after
    the other in the order given, and listed in parallel like any other folders.

    Args:
        objects: the reader of the source's storage.
        root: the folder URL.
        entry: the sort text of a kept file name, or None to leave the file out.
        rejected: collects the relative paths of the files ``entry`` left out.
        tops: the folders under ``root`` to walk, in this order (default: all of ``root``).
        threads: list calls in flight at once (default :data:`LIST_THREADS`).
        ahead: directories listed ahead of the consumer.

    Yields:
        (relative posix path, size) of each kept object, in order.

    Raises:
        SourceNotFoundError: nothing is under ``root``.
        SourceError: a listing failed.
    """
    root = root.rstrip("/")

    def scan(rel: str) -> _Listing:
        try:
            files, dirs = list_dir(objects, join_url(root, rel) if rel else root)
        except SourceNotFoundError:
            if not rel:
                raise
            return []  # emptied since its parent was listed
        names: _Listing = [(d + "/", -1) for d in dirs]
        for name, size in files:
            kept = entry(name)
            if kept is None:
                if rejected is not None:
                    rejected.append(rel + name)
                continue
            names.append((kept, size))
        names.sort(reverse=True)
        return names

    pool = ThreadPoolExecutor(threads or LIST_THREADS, thread_name_prefix="shardkit-list")
    queued: deque[str] = deque()  # directories to list, in the order they will be consumed
    listed: dict[str, Future[_Listing]] = {}

    def top_up() -> None:
        while queued and len(listed) < ahead:
            rel = queued.popleft()
            listed[rel] = pool.submit(scan, rel)

    try:
        stack: list[tuple[str, _Listing]] = []

        def enter(rel: str) -> None:
            names = listed.pop(rel).result()
            # Its subdirectories are consumed next, before anything queued already.
            queued.extendleft(reversed(sorted(rel + n for n, size in names if size < 0)))
            stack.append((rel, names))
            top_up()

        if tops is None:
            listed[""] = pool.submit(scan, "")
            enter("")
        else:  # a made-up root listing the given folders, popped in the order given
            queued.extend(f"{t}/" for t in tops)
            top_up()
            stack.append(("", [(f"{t}/", -1) for t in reversed(tops)]))
        while stack:
            rel, names = stack[-1]
            if not names:
                stack.pop()
                continue
            name, size = names.pop()
            if size < 0:
                sub = rel + name
                if sub not in listed:  # not read ahead (the window was full): list it now
                    queued.remove(sub)
                    listed[sub] = pool.submit(scan, sub)
                enter(sub)
                continue
            yield rel + name.replace("\0", ".", 1), size
    finally:
        for fut in listed.values():
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
