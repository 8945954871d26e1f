"""A source of N independent parts: part ``i`` is an iterable of sample dicts of its own.

Unlike one iterable, parts can run at once (one Ray task each) and a rerun redoes only the
parts not done: every part's output depends on the part alone (its shards are named by its
index, its default keys are ``<part>-<item>``), so a part is packed the same way wherever and
whenever it runs. Samples are the dicts :mod:`shardkit.packing.sources.iterable` reads.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

from shardkit.errors import ConfigError, SourceError
from shardkit.packing.sample import PackSample
from shardkit.packing.sources.iterable import samples_from_iterable
from shardkit.packing.transforms import describe_transform

__all__ = ["Parts", "as_parts", "part_key", "part_samples"]

PartFn = Callable[[int], Iterable[dict[str, Any]]]


def part_key(part: int, item: int) -> str:
    """The key of item ``item`` of part ``part`` when the sample dict has no ``__key__``.

    Args:
        part: the part's index.
        item: the item's index in its part.

    Returns:
        ``PPPPP-IIIIIIIII``: unique across parts, and the same wherever the part runs.
    """
    return f"{part:05d}-{item:09d}"


class _Items:
    """Part ``i`` of a list given to :func:`as_parts`: an iterable, or a callable making one."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __call__(self, part: int) -> Iterable[dict[str, Any]]:
        got = self.items[part]
        return got() if callable(got) else got


class Parts:
    """``n`` parts, part ``i`` being the sample dicts ``fn(i)`` yields.

    ``fn`` runs where the part is packed (a Ray task: pickled with cloudpickle, so a lambda or
    a closure works), and a rerun of the same pack resumes only with the same ``fn`` (its name,
    code and the values it closes over, as a transform's identity) and ``n``.

    Example::

        shardkit.pack(shardkit.Parts(lambda i: ({"txt": f"{i}-{j}"} for j in range(100)), 8), url)

    Args:
        fn: part index -> an iterable of sample dicts.
        n: the number of parts (>= 1).
        name: the identity a rerun must match, instead of the digest of ``fn`` (for a function
            whose closure cannot be digested, or to keep resuming across edits that do not
            change its output).

    Raises:
        ConfigError: ``n`` is below 1 or ``fn`` is not callable.
    """

    def __init__(self, fn: PartFn, n: int, name: str | None = None) -> None:
        if not callable(fn):
            raise ConfigError(f"Parts: fn must be a callable of the part index, got {type(fn).__name__}")
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"Parts: n must be an int >= 1, got {n!r}")
        self.fn = fn
        self.n = n
        self.name = name

    def describe(self) -> dict[str, Any]:
        """Describe the source for dataset.json and the plan (a rerun resumes the same one).

        Returns:
            ``{"type": "parts", "parts": n, "fn": <identity>}``.
        """
        # A list's identity digests its items' values (or the callables' code), so a rerun
        # resumes only the same lists.
        ident = {"name": self.name} if self.name is not None else describe_transform(self.fn)
        return {"type": "parts", "parts": self.n, "fn": ident}

    def samples(self, part: int, skipped: list[dict[str, str]] | None = None) -> Iterator[PackSample]:
        """Part ``part``'s samples; whatever the part raises becomes one line naming it.

        Args:
            part: the part's index.
            skipped: with ``on_error="skip"``, gets each bad item (left out); None raises.

        Returns:
            The part's samples, in order, from :func:`part_samples` (which names the part in
            any error the part raises as they are read).
        """
        return part_samples(part, lambda: self.fn(part), skipped)


def part_samples(part: int, items: Callable[[], Iterable[dict[str, Any]]],
                 skipped: list[dict[str, str]] | None = None) -> Iterator[PackSample]:
    """The samples of part ``part``; whatever it raises becomes one line naming the part.

    Args:
        part: the part's index (its default keys are :func:`part_key`).
        items: makes the part's sample dicts (called here, so its error is named too).
        skipped: with ``on_error="skip"``, gets each bad item (left out); None raises.

    Yields:
        The part's samples, in order.

    Raises:
        SourceError: naming the part and the item (a bad sample, a repeated key in the part,
            or any error the part's code raised).
    """
    done = 0
    last = ""
    try:
        for sample in samples_from_iterable(items(), skipped, default_key=lambda i: part_key(part, i)):
            done, last = done + 1, sample.key
            yield sample
    except SourceError as exc:
        raise SourceError(f"part {part}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's code: any error, named by part and item
        after = f" (after key {last!r})" if last else ""
        text = str(exc).splitlines()[0] if str(exc) else ""
        raise SourceError(f"part {part}: item {done}{after} raised {type(exc).__name__}: {text}") from exc


def as_parts(source: Any) -> Parts | None:
    """``source`` as :class:`Parts` if it is one, or a list or tuple of iterables or zero-argument
    callables returning iterables (one per part); None for anything else.

    A list of dicts stays an iterable of samples (a single stream).

    Args:
        source: what :func:`~shardkit.pack` was given.

    Returns:
        The parts, or None.
    """
    if isinstance(source, Parts):
        return source
    if not isinstance(source, (list, tuple)) or not source:
        return None
    if all(callable(x) or (hasattr(x, "__iter__") and not isinstance(x, (dict, str, bytes))) for x in source):
        return Parts(_Items(source), len(source))
    return None
