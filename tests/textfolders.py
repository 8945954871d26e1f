"""Small keyed folders of text files: the source of the version and append tests."""

from __future__ import annotations

from pathlib import Path

__all__ = ["A", "B", "text_folder"]

A = [f"a{i:02d}" for i in range(12)]  # a first version's keys
B = [f"b{i:02d}" for i in range(6)]  # an appended version's keys


def text_folder(root: Path, keys: list[str], body: str = "body", repeat: int = 10) -> Path:
    """A folder with one ``<key>.txt`` per key, whose text names the key.

    Args:
        root: the folder (made if missing).
        keys: the samples' keys.
        body: the first word of each text (another word gives other bytes for the same keys).
        repeat: how many times the text repeats (sets the samples' size).

    Returns:
        ``root``.
    """
    root.mkdir(parents=True, exist_ok=True)
    for k in keys:
        (root / f"{k}.txt").write_text(f"{body} of {k} " * repeat)
    return root
