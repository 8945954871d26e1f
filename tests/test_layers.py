"""The package layout is the data flow: lower layers never import higher ones, no cycles, torch
only in shardkit.datasets. Checked on the source with ``ast``, so a function-level import that
would hide a cycle counts like any other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "shardkit"

# package -> the shardkit packages it may import ("base" = errors, config, util and the root).
ALLOWED: dict[str, set[str]] = {
    "base": {"base"},
    "format": {"base"},
    "storage": {"base"},
    "cache": {"base", "format", "storage"},
    "read": {"base", "format", "storage", "cache"},
    "batch": {"base", "format", "storage", "cache", "read"},
    "packing": {"base", "format", "storage", "read"},
    "datasets": {"base", "format", "storage", "cache", "read", "batch"},
    "dev": {"base", "format", "storage", "cache", "read", "batch", "packing", "datasets"},
    "ray": {"base", "format", "storage", "read", "packing"},  # shardkit.ray: the Ray Data datasink's public face
    "cli": {"base", "format", "storage", "cache", "read", "batch", "packing", "datasets", "dev"},
}
# Modules that may import torch: the torch-facing package, and the demo whose baseline is a
# plain torch Dataset beside shardkit's.
TORCH_OK = ("shardkit.datasets", "shardkit.dev.demo")


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("errors", "config", "util"):
        return "base"
    if parts[1] in ("demo", "devserver"):  # compatibility shims for `python -m shardkit.demo`
        return "dev"
    return parts[1]


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports (top level, in functions, under TYPE_CHECKING), with lines."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # `from shardkit.read import segments` imports the module shardkit.read.segments
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names
                      if (PKG.parent / f"{target}.{alias.name}".replace(".", "/")).with_suffix(".py").exists()]
    return found


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def shardkit_imports(module: str) -> set[str]:
    out = set()
    for target, _ in imports_of(MODULES[module]):
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target.startswith("shardkit") and target != module:
            out.add(target)
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports_only_lower_layers(module: str) -> None:
    mine = layer(module)
    bad = sorted(t for t in shardkit_imports(module) if t != "shardkit" and layer(t) not in ALLOWED[mine] | {mine})
    assert not bad, f"{module} ({mine}) imports {bad}: allowed layers are {sorted(ALLOWED[mine])}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_datasets_package_imports_torch(module: str) -> None:
    torch = [line for target, line in imports_of(MODULES[module]) if target.split(".")[0] == "torch"]
    if module.startswith(TORCH_OK):
        return
    assert not torch, f"{module} imports torch (lines {torch}); only {TORCH_OK} may"


def test_no_import_cycles() -> None:
    graph = {m: shardkit_imports(m) - {"shardkit"} for m in MODULES}
    # Tarjan's strongly connected components; any component of two or more modules is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The rules above are only worth something if the parser finds imports of every form."""
    src = tmp_path / "shardkit" / "format" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from ..packing import pack\n    import torch\n")
    global PKG
    saved = PKG
    try:
        PKG = tmp_path / "shardkit"
        found = {t for t, _ in imports_of(src)}
    finally:
        PKG = saved
    assert "shardkit.packing" in found and "torch" in found
