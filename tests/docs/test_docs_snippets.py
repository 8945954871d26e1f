"""Every ```python block of README.md and docs/**/*.md runs, in page order, against real data.

Conventions the pages follow (docs/contributing.md says the same for writers):

- Blocks of one page run in order in one namespace: a later block sees an earlier block's names.
- Dataset URLs are ``s3://shardkit/<name>`` (the bucket docker-compose's MinIO makes). Each page
  runs against its own fresh bucket on the session's SeaweedFS, with the ``AWS_*`` variables
  pointed at it; the test rewrites ``s3://shardkit/`` to that bucket.
- ``/nvme/...`` paths (the node cache) are rewritten to a directory of the page's own.
- Inputs are relative paths (``./imagenet/train``, ``./volumes``, ``./big.h5``, ...): the page
  runs in a fresh working directory that holds them (tests/docs/docs_data.py makes them).
- A page that reads a dataset it does not pack itself names it in a comment,
  ``<!-- snippet: needs s3://shardkit/imagenet -->``; the test packs it first.
- A block that cannot run here (torchrun across processes, a Ray cluster) has
  ``<!-- snippet: skip (why) -->`` on the line before it. Few pages may rely on that.
"""

from __future__ import annotations

import gc
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from docs_data import BUCKET, DATASETS, SOURCES, make_sources

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
MAX_PAGES_WITH_SKIPS = 3  # skipped blocks are untested documentation: keep them rare

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip\s*\((?P<why>[^)]+)\)\s*-->\s*$")
_NEEDS = re.compile(r"<!--\s*snippet:\s*needs\s+(?P<urls>[^>]*?)\s*-->")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, first code line (1-based) and text."""

    lang: str
    line: int
    code: str
    skip: str | None  # the reason given, for a block marked skip


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order (indented fences in lists too)."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, indent = m["fence"], m["indent"]
        lang = (m["info"].split() or [""])[0].lower()
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = _SKIP.match(prev)
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        start = i - len(body) + 1
        out.append(Block(lang, start, textwrap.dedent("\n".join(body)) + "\n", skip["why"] if skip else None))
        i += 1
    return out


def python_blocks(path: Path) -> list[Block]:
    return [b for b in blocks_of(path) if b.lang in ("python", "py")]


def needs_of(path: Path) -> list[str]:
    return [url for m in _NEEDS.finditer(path.read_text()) for url in m["urls"].split()]


RUNNABLE = [p for p in PAGES if python_blocks(p)]


@pytest.fixture(scope="session")
def doc_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sources(tmp_path_factory.mktemp("doc-sources"))


def test_few_pages_skip_blocks() -> None:
    skipping = {p.relative_to(REPO).as_posix(): [b.line for b in python_blocks(p) if b.skip]
                for p in RUNNABLE}
    skipping = {page: lines for page, lines in skipping.items() if lines}
    assert len(skipping) <= MAX_PAGES_WITH_SKIPS, (
        f"{len(skipping)} pages have python blocks marked '<!-- snippet: skip -->' ({skipping}); at most "
        f"{MAX_PAGES_WITH_SKIPS} may: make the others runnable (see this module's docstring)")


def test_pages_have_runnable_examples() -> None:
    # The extraction itself: a fence the parser misses would leave a page silently untested.
    assert REPO / "README.md" in RUNNABLE
    assert len(RUNNABLE) >= 10, [p.name for p in RUNNABLE]
    for page in PAGES:
        opened = len(re.findall(r"^[ \t]*```python", page.read_text(), re.M))
        assert opened == len([b for b in blocks_of(page) if b.lang == "python"]), page


def test_needs_name_known_datasets() -> None:
    for page in PAGES:
        for url in needs_of(page):
            assert url in DATASETS, f"{page}: needs {url}, which tests/docs/docs_data.py does not make"


@pytest.mark.s3
@pytest.mark.parametrize("page", RUNNABLE, ids=[p.relative_to(REPO).as_posix() for p in RUNNABLE])
def test_page_examples_run(page: Path, doc_sources: Path, s3_env: object, s3_bucket: str, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for name in SOURCES:
        (work / name).symlink_to(doc_sources / name)
    monkeypatch.chdir(work)
    rewrite = {f"s3://{BUCKET}/": f"{s3_bucket}/", "/nvme/": f"{tmp_path}/nvme/"}

    def local(text: str) -> str:
        for old, new in rewrite.items():
            text = text.replace(old, new)
        return text

    for url in needs_of(page):
        DATASETS[url](doc_sources, local(url))
    namespace: dict[str, object] = {"__name__": "__docs__"}
    try:
        for block in python_blocks(page):
            if block.skip:
                continue
            print(f"--- {page.relative_to(REPO)}:{block.line}")  # shown with a failure's captured output
            # Padded so that a traceback names the Markdown file and its own line numbers.
            code = compile("\n" * (block.line - 1) + local(block.code), str(page), "exec")
            exec(code, namespace)  # noqa: S102 - running the documentation is the point
    finally:
        namespace.clear()  # loaders and their worker processes go now, not at the next test
        gc.collect()
