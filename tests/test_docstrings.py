"""Every module says what it is for and what it exports; every public callable is documented.

Public means listed in its module's ``__all__`` and defined there. A function (or a class's
``__init__``) that takes arguments documents them under ``Args:``; one that returns something
says so under ``Returns:`` (``Yields:`` for generators). Checked on the source with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "shardkit"
MODULES = sorted(p for p in PKG.rglob("*.py"))


def _name(path: Path) -> str:
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")


def _exports(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                # literal names only: `[*_LAZY, "errors"]` in shardkit/__init__.py lists lazy names
                return [e.value for e in node.value.elts  # type: ignore[attr-defined]
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return [n for n in names if n not in ("self", "cls")]


def _returns_value(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    ann = fn.returns
    return not (ann is None or (isinstance(ann, ast.Constant) and ann.value is None)
                or (isinstance(ann, ast.Name) and ann.id in ("None", "NoReturn")))


def _is_generator(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(fn))


def problems_of(fn: ast.FunctionDef | ast.AsyncFunctionDef, where: str, doc: str | None = None) -> list[str]:
    """What the docstring of ``fn`` (or ``doc``, a class docstring standing for its __init__) lacks."""
    doc = doc if doc is not None else ast.get_docstring(fn)
    if not doc:
        return [f"{where}: no docstring"]
    out = []
    if _params(fn) and "Args:" not in doc:
        out.append(f"{where}: no Args: for {_params(fn)}")
    if fn.name != "__init__" and _returns_value(fn):
        wanted = "Yields:" if _is_generator(fn) else "Returns:"
        if wanted not in doc and "Returns:" not in doc:
            out.append(f"{where}: no {wanted}")
    return out


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_module_has_a_docstring_and_all(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{_name(path)}: no module docstring"
    if path.name != "__init__.py" and _name(path) != "shardkit.__main__":
        assert _exports(tree) is not None, f"{_name(path)}: no __all__"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_public_callables_are_documented(path: Path) -> None:
    tree = ast.parse(path.read_text())
    exported = set(_exports(tree) or [])
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in exported:
            found += problems_of(node, f"{_name(path)}.{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name in exported:
            where = f"{_name(path)}.{node.name}"
            class_doc = ast.get_docstring(node)
            if not class_doc:
                found.append(f"{where}: no docstring")
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if item.name == "__init__":  # documented in the class docstring (Google style)
                    found += problems_of(item, f"{where}.__init__", doc=class_doc or "")
                elif not item.name.startswith("_") and not any(
                        isinstance(d, ast.Name) and d.id in ("property", "overload") or
                        isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter") for d in item.decorator_list):
                    found += problems_of(item, f"{where}.{item.name}")
    assert not found, "\n".join(found)


def test_the_checker_finds_an_undocumented_argument() -> None:
    fn = ast.parse('def f(x: int) -> int:\n    """Does f."""\n    return x\n').body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert problems_of(fn, "f") == ["f: no Args: for ['x']", "f: no Returns:"]
