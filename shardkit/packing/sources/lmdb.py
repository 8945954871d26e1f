"""LMDB environments as a source: each key -> value pair is one sample, the value one field.

The environment is opened read-only with ``lock=False`` (no lock file is written, so a
read-only copy or mount works), from local disk only: LMDB is a memory-mapped file format.
Listing walks a cursor and keeps per key only what the planner needs (a :class:`SourceItem`),
so 20 M keys do not hold 20 M values or raw keys in the driver.

Sample keys (:func:`lmdb_key`): a key that already is tar-safe stays as it is; any other is
``_`` plus its bytes in hex, so two keys never collide, and the original key is kept exactly
as the manifest's ``lmdb_key`` column (bytes).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from typing import Any

from shardkit.errors import SourceError, SourceNotFoundError
from shardkit.packing.sample import MAX_KEY, PackSample, check_field_name
from shardkit.packing.sources.base import SourceItem, item_bytes
from shardkit.packing.sources.optional import require

__all__ = ["LmdbSource", "lmdb_key"]

# Kept as they are: what safe_key keeps, less a leading "_" (which marks the encoded keys).
_PLAIN = re.compile(r"[A-Za-z0-9\-][A-Za-z0-9_\-]*")
# The longest raw key whose hex form (plus the "_") still fits MAX_KEY.
_MAX_HEX = (MAX_KEY - 1) // 2


def lmdb_key(raw: bytes) -> str:
    """The sample key of the LMDB key ``raw``: deterministic, tar-safe and unique.

    ``raw`` itself when it is ASCII letters, digits, ``-`` and ``_`` not starting with ``_``
    (at most MAX_KEY characters); else ``_`` + ``raw.hex()`` (keys up to 79 bytes); else
    ``_z`` + a 128-bit BLAKE2b digest in hex. The three forms cannot meet: plain keys never
    start with ``_``, hex never holds ``z``, and hex is one-to-one.

    Args:
        raw: the LMDB key.

    Returns:
        The key.
    """
    if len(raw) <= MAX_KEY and raw.isascii():
        text = raw.decode("ascii")
        if _PLAIN.fullmatch(text):
            return text
    if len(raw) <= _MAX_HEX:
        return "_" + raw.hex()
    return "_z" + hashlib.blake2b(raw, digest_size=16).hexdigest()


def _raw_of(ref: str) -> bytes:
    """The LMDB key an item's ``ref`` stands for (the inverse of :func:`_ref_of`)."""
    return bytes.fromhex(ref[1:]) if ref.startswith("_") else ref.encode("ascii")


def _ref_of(raw: bytes, key: str) -> str:
    """An item's ``ref``: its key itself (one string per item) unless the key is a digest, which
    cannot give the LMDB key back."""
    return key if not key.startswith("_z") else "_" + raw.hex()


class _Env:
    """An environment as one process opened it, shared by every source reading that path in the
    process (py-lmdb refuses a second open of one path in a process; copies of one source, as
    unpickled into tasks, meet that) and closed when the last lets go."""

    def __init__(self, env: Any) -> None:
        self.pid = os.getpid()  # an environment must not be used across a fork
        self.env = env
        self.users = 0


_ENVS: dict[tuple[str, bool], _Env] = {}
_ENVS_LOCK = threading.Lock()


def _acquire(lmdb: Any, path: str, subdir: bool) -> _Env:
    """The process's open environment at ``path``, opened now if it is not."""
    with _ENVS_LOCK:
        held = _ENVS.get((path, subdir))
        if held is None or held.pid != os.getpid():  # a forked child opens its own
            held = _ENVS[(path, subdir)] = _Env(_open_env(lmdb, path, subdir))
        held.users += 1
        return held


def _release(path: str, subdir: bool, held: _Env) -> None:
    """Let go of ``held``; the last user in the process that opened it closes it."""
    with _ENVS_LOCK:
        if held.pid != os.getpid():
            return  # the parent's: left alone in a forked child
        held.users -= 1
        if held.users <= 0:
            if _ENVS.get((path, subdir)) is held:
                del _ENVS[(path, subdir)]
            held.env.close()


def _data_file(path: str, subdir: bool) -> str:
    return os.path.join(path, "data.mdb") if subdir else path


def _open_env(lmdb: Any, path: str, subdir: bool) -> Any:
    """The environment opened read-only, refusing a truncated data file before any page of it
    is touched: a page past the end of a memory-mapped file kills the process (SIGBUS)."""
    data = _data_file(path, subdir)
    if not os.path.isfile(data):
        raise SourceNotFoundError(f"{data}: no such LMDB data file")
    try:
        env = lmdb.open(path, subdir=subdir, readonly=True, lock=False, max_dbs=0, readahead=False)
    except lmdb.Error as exc:
        raise SourceError(f"{data}: not a readable LMDB environment ({exc}); check the file, or copy it again") from exc
    try:
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        size = os.path.getsize(data)
    except (lmdb.Error, OSError) as exc:
        env.close()
        raise SourceError(f"{data}: not a readable LMDB environment ({exc}); check the file, or copy it again") from exc
    if size < need:
        env.close()
        raise SourceError(f"{data}: truncated LMDB file ({size} bytes, its pages need {need}); copy it again")
    return env


class LmdbSource:
    """The key -> value pairs of an LMDB environment as samples.

    Args:
        path: a directory holding ``data.mdb``, or the ``.mdb``/``.lmdb`` data file itself
            (read with ``subdir=False``); a local path (``file://`` too).
        field: the field each value is packed as, a decoder hint such as ``jpg``, ``npy``,
            ``json`` (default ``bin``).
        subdir: whether ``path`` is a directory (default: sniffed).

    Each sample's key is :func:`lmdb_key` of its LMDB key, its only field ``field``, and its
    manifest row's ``lmdb_key`` column the LMDB key's bytes.

    Raises:
        SourceError: ``path`` is a URL (copy it locally first), or ``field`` is no valid
            field name.
    """

    def __init__(self, path: str | os.PathLike[str], *, field: str = "bin", subdir: bool | None = None) -> None:
        text = os.fspath(path)
        if "://" in text and not text.startswith("file://"):
            raise SourceError(f"LMDB source {text}: LMDB is a memory-mapped file format read from local disk only; "
                              "copy it to a local path first")
        self.path = os.path.abspath(text[len("file://"):] if text.startswith("file://") else text)
        self.subdir = os.path.isdir(self.path) if subdir is None else subdir
        self.field = field.lower()
        try:
            check_field_name(self.field)
        except SourceError as exc:
            raise SourceError(f"lmdb_field (--lmdb-field {field}): {exc}") from None
        self._env: _Env | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The path and options only: an open environment never crosses a process boundary."""
        state = dict(self.__dict__)
        state["_env"] = None
        return state

    def __repr__(self) -> str:
        return f"LmdbSource({self.path!r}, field={self.field!r})"

    def task_done(self) -> None:
        """Close the environment ``load`` kept open in this process; a later ``load`` reopens
        it. The packer calls this after each task."""
        held, self._env = self._env, None
        if held is not None:
            _release(self.path, self.subdir, held)

    def list_items(self) -> list[SourceItem]:
        """One item per key, in LMDB's (byte) order, reading keys and value sizes only.

        Returns:
            The items.

        Raises:
            SourceNotFoundError: there is no data file.
            SourceError: lmdb is not installed, the environment is truncated, corrupt or
                empty.
        """
        lmdb = require("lmdb")
        data = _data_file(self.path, self.subdir)
        held = _acquire(lmdb, self.path, self.subdir)
        items: list[SourceItem] = []
        field = self.field
        try:
            with held.env.begin(buffers=True) as txn:
                # Buffers: keys and values are views of the map, so a value's size is known without
                # copying it (a large value's pages are not even touched).
                for raw, value in txn.cursor().iternext(keys=True, values=True):
                    rawb = bytes(raw)
                    key = lmdb_key(rawb)
                    items.append(SourceItem(ref=_ref_of(rawb, key), nbytes=item_bytes(key, [(field, len(value))]),
                                            key=key))
        except lmdb.Error as exc:
            raise SourceError(f"{data}: corrupt LMDB environment after {len(items)} keys ({exc}); copy it again") \
                from exc
        finally:
            _release(self.path, self.subdir, held)
        if not items:
            raise SourceError(f"{data}: the LMDB environment holds no keys")
        return items

    def load(self, item: SourceItem) -> PackSample:
        """Read one key's value.

        Args:
            item: one of :meth:`list_items`.

        Returns:
            The sample: field ``field`` holds the value's bytes; meta ``lmdb_key`` the key.

        Raises:
            SourceError: the environment is unreadable, truncated or corrupt, or the key is
                gone.
        """
        lmdb = require("lmdb")
        if self._env is None or self._env.pid != os.getpid():
            self._env = _acquire(lmdb, self.path, self.subdir)
        raw = _raw_of(item.ref)
        data = _data_file(self.path, self.subdir)
        try:
            with self._env.env.begin() as txn:
                value = txn.get(raw)
        except lmdb.Error as exc:
            raise SourceError(f"{data}: corrupt LMDB environment reading key {raw!r} ({exc}); copy it again") from exc
        if value is None:
            raise SourceError(f"{data}: key {raw!r} is gone (the environment changed since it was listed)")
        return PackSample(key=item.key, fields={self.field: value}, meta={"lmdb_key": raw})

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json.

        Returns:
            ``{"type": "lmdb", "path": ..., "field": ...}``.
        """
        return {"type": "lmdb", "path": self.path, "field": self.field}

    def labels(self) -> dict[str, int] | None:
        """An LMDB source has no classes.

        Returns:
            None.
        """
        return None
