"""The documentation builds strictly and stays in step with the code and the benchmark results.

The strict build fails on a broken link or anchor, a page missing from the navigation, and an
API reference (``::: shardkit...``) that does not resolve or whose docstring does not parse.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def _mkdocs() -> list[str] | None:
    """How to run mkdocs: this interpreter's, or the executable ``SHARDKIT_MKDOCS`` names (a
    separate docs environment)."""
    if importlib.util.find_spec("mkdocs") is not None:
        return [sys.executable, "-m", "mkdocs"]
    given = os.environ.get("SHARDKIT_MKDOCS")
    if given:
        return [given]
    return None


@pytest.mark.timeout(240)
def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    mkdocs = _mkdocs()
    if mkdocs is None:
        message = "mkdocs is not installed (pip install -e '.[docs]', or set SHARDKIT_MKDOCS)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)  # CI installs .[test], which has it: a skip would hide a gap
        pytest.skip(message)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([*mkdocs, "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=220, env=env)
    problems = [line for line in proc.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0, "\n".join(problems) or proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "datasets" / "index.html").is_file()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public accessor for them
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_cli_page_lists_every_command_and_option() -> None:
    page = (DOCS / "reference" / "cli.md").read_text()
    parser = build_parser()
    commands = _subparsers(parser)
    assert commands, "shardkit has subcommands"
    missing = [opt for action in parser._actions for opt in action.option_strings if f"`{opt}" not in page]
    for name, sub in commands.items():
        if f"## `shardkit {name}`" not in page:
            missing.append(f"section for `shardkit {name}`")
        for action in sub._actions:
            names = action.option_strings or ([action.dest] if action.dest not in ("help", "bench_args") else [])
            missing += [f"{name} {opt}" for opt in names if f"`{opt}" not in page]
    assert not missing, f"docs/reference/cli.md lacks {missing}"


def test_api_reference_covers_every_public_name() -> None:
    import shardkit

    refs = {m.group(1) for page in (DOCS / "reference").glob("*.md")
            for m in re.finditer(r"^::: (\S+)", page.read_text(), re.M)}
    for name in shardkit.__all__:
        if name == "__version__":
            continue
        if name == "errors":
            assert "shardkit.errors" in refs
            continue
        module = shardkit._LAZY[name].lstrip(".")
        assert f"shardkit.{module}.{name}" in refs, f"no '::: shardkit.{module}.{name}' in docs/reference/"


def test_readme_links_resolve() -> None:
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target = REPO / link.split("#", 1)[0]
        assert target.exists(), f"README.md links to {link}, which does not exist"


def test_docs_cite_no_missing_files() -> None:
    """Every ``*.md`` file the README and the docs name is a file of the repository: a page never
    sends a reader to a file that does not ship with it."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for page in [REPO / "README.md", *DOCS.rglob("*.md")]:
        for cited in sorted(set(re.findall(r"[\w./-]*\w\.md\b", page.read_text()))):
            name = cited.lstrip("./")
            assert any(f == name or f.endswith("/" + name) for f in tracked), \
                f"{page.relative_to(REPO)} cites {cited}, which is not in the repository"


def _normal(text: str) -> str:
    return " ".join(text.split())


def _quotes(page: Path) -> list[str]:
    """The quoted passages (``> ...`` blocks) of a page: table rows one by one, prose whole."""
    out: list[str] = []
    block: list[str] = []
    for line in [*page.read_text().splitlines(), ""]:
        if line.startswith(">"):
            block.append(line[1:].strip())
            continue
        if block:
            rows = [b for b in block if b.startswith("|")]
            out += rows if rows else [" ".join(block)]
            block = []
    return out


def test_quoted_figures_appear_in_results() -> None:
    results = _normal((REPO / "benchmarks" / "RESULTS.md").read_text())
    quotes = _quotes(DOCS / "benchmarks.md")
    assert len(quotes) >= 20, quotes
    stale = [q for q in quotes if _normal(q) not in results]
    assert not stale, f"docs/benchmarks.md quotes passages benchmarks/RESULTS.md no longer has: {stale}"


def test_make_docs_builds_strictly() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^docs:", makefile, re.M) and re.search(r"^\.PHONY:.*\bdocs\b", makefile, re.M)
    assert "mkdocs build --strict -d build/site" in makefile


_PACKAGES = ("format", "storage", "cache", "read", "batch", "datasets", "packing", "dev", "util")
_MODULE_REF = re.compile(r"`(?:python -m )?(?:shardkit\.)?((?:%s)\.[a-z_]+)[\w.]*" % "|".join(_PACKAGES))


def test_module_paths_named_in_the_docs_exist() -> None:
    # Modules are still moving between packages: a page naming one that moved is out of date.
    missing = []
    for page in [REPO / "README.md", *DOCS.rglob("*.md")]:
        for dotted in _MODULE_REF.findall(page.read_text()):
            path = REPO / "shardkit" / Path(*dotted.split("."))
            if not (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
                missing.append(f"{page.relative_to(REPO)}: shardkit.{dotted}")
    assert not missing, missing
