"""Listing the files under a folder in sorted order, streamed, without holding the listing.

A folder may hold tens of millions of files: the walk keeps only the names of the directories
on its current path and stats each file as it yields it, so listing costs a few hundred bytes
a file however many there are.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

from shardkit.errors import SourceError

__all__ = ["walk_in_order"]


def walk_in_order(root: str, entry: Callable[[str], str | None],
                   rejected: list[str] | None = None) -> Iterator[tuple[str, int]]:
    """(relative posix path, size) of the files under ``root`` that ``entry`` keeps, in the
    order of their relative paths as ``entry`` spells the names, streamed.

    ``entry(name)`` is the text a kept file name sorts by within its directory (the name, or
    for sample order the name with its first dot made a NUL, so that ``a.jpg`` comes before
    ``a-b.jpg`` as the key ``a`` before ``a-b``), or None for a file that is left out (its
    relative path is appended to ``rejected`` if given). A directory sorts as its name and a
    ``/``: sorting each directory's entries so and descending into each subdirectory in its
    place gives the order of a sort of all the relative paths (a name holds no ``/`` or NUL).

    Hidden files are left out. Symlinks to files are followed (users lay out datasets with
    them); symlinked directories are not, so a link loop cannot hang the listing. Dangling
    symlinks are listed (size 0) so that loading them fails with an error naming them.

    Only the names of the directories on the current path are held (each list shrinking as
    it is walked), and each file's ``stat`` happens as it is yielded: collecting and sorting
    (path, size) tuples first would hold every file's tuple at once.

    Args:
        root: the folder to walk.
        entry: the sort text of a kept file name, or None to leave the file out.
        rejected: collects the relative paths of the files ``entry`` left out.

    Yields:
        (relative posix path, size) of each kept file, in order.

    Raises:
        SourceError: a directory cannot be listed or a file cannot be stat'ed.
    """
    stack = [_scan_dir(root, "", entry, rejected)]
    while stack:
        path, prefix, names, dangling = stack[-1]
        if not names:
            stack.pop()
            continue
        name = names.pop()  # sorted descending: popping from the end frees the list as it goes
        if name[-1] == "/":
            stack.append(_scan_dir(path + name[:-1], prefix + name, entry, rejected))
            continue
        name = name.replace("\0", ".", 1)
        if dangling is not None and name in dangling:
            yield prefix + name, 0
            continue
        try:
            size = os.stat(path + name).st_size
        except OSError as exc:
            raise SourceError(f"cannot stat {path + name}: {exc.strerror}") from exc
        yield prefix + name, size


def _scan_dir(d: str, prefix: str, entry: Callable[[str], str | None],
              rejected: list[str] | None) -> tuple[str, str, list[str], set[str] | None]:
    """One directory of :func:`walk_in_order`: (its path ending in a separator, its relative
    path ditto, its kept entries sorted descending, its dangling symlinks' names or None)."""
    try:
        scan = os.scandir(d)
    except PermissionError as exc:
        raise SourceError(f"cannot list {d}: permission denied") from exc
    path = os.path.join(d, "")
    names: list[str] = []
    dangling: set[str] | None = None
    with scan:
        for e in scan:
            name = e.name
            if name.startswith("."):
                continue
            if e.is_dir(follow_symlinks=False):
                names.append(name + "/")
                continue
            if e.is_file():
                lost = False
            elif e.is_symlink() and not os.path.exists(e.path):
                # A dangling link is a file the user meant to pack whose data is gone: list it,
                # so loading it fails naming it (or on_error="skip" records it), never drop it silently.
                lost = True
            else:
                continue
            kept = entry(name)
            if kept is None:
                if not lost:  # stat as the files that are kept: an unreadable one is an error all the same
                    try:
                        e.stat()
                    except OSError as exc:
                        raise SourceError(f"cannot stat {e.path}: {exc.strerror}") from exc
                if rejected is not None:
                    rejected.append(prefix + name)
                continue
            names.append(kept)
            if lost:
                dangling = dangling or set()
                dangling.add(name)
    names.sort(reverse=True)
    return path, prefix, names, dangling
