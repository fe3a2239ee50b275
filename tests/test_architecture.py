"""The package's layers (docs/architecture.md): every import of ours, at the top of a module,
inside a function or under TYPE_CHECKING, points into the same folder or a lower one; no import
circle between modules; nothing in zygote/ or ranks/ reaches the driver or the controller; the
pure modules import no torch, pytest or xdist; no module reads another module's private names."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import xdist_megatron

PACKAGE = Path(xdist_megatron.__file__).parent
NAME = PACKAGE.name
# Top to bottom. The modules beside plugin.py (protocol, markers, layouts, placement,
# sidechannel) are the bottom layer, "base"; plugin.py, engage.py and __init__.py sit above
# everything.
LAYERS = (
    "top",
    "controller",
    "report",
    "harnesses",
    "driver",
    "ci",
    "zygote",
    "ranks",
    "coverage",
    "base",
)
TOP_MODULES = {NAME, f"{NAME}.plugin", f"{NAME}.engage"}
PURE = {
    f"{NAME}.placement",
    f"{NAME}.ci.sharding",
    f"{NAME}.controller.splitting",
    f"{NAME}.controller.worker_launcher",  # it starts in milliseconds: the standard library only
}
HEAVY = ("torch", "pytest", "_pytest", "xdist", "execnet")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> str:
    """'top', the folder the module lies in, or 'base' for the modules beside plugin.py."""
    if module in TOP_MODULES:
        return "top"
    first = module.split(".")[1]
    return first if (PACKAGE / first).is_dir() else "base"


def imports(module: str, tree: ast.Module, known: set[str]) -> list[tuple[str, int]]:
    """Every module of ours that `module` imports, with the line: `from . import x` counts as
    importing `x` when `x` is a module, else its package."""
    is_package = (PACKAGE / Path(*module.split(".")[1:]) / "__init__.py").exists()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in known else source
                for a in node.names
            ]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t == NAME or t.startswith(NAME + ".")]
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    trees = modules()
    known = set(trees)
    return {
        m: [(t, line) for t, line in imports(m, tree, known) if t != m] for m, tree in trees.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def test_the_layers_are_as_the_docs_list_them() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {"top", "base"}
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    order = " > ".join(f"`{name}/`" for name in LAYERS if name not in ("top", "base"))
    assert order in docs


def test_every_import_points_to_its_own_layer_or_a_lower_one() -> None:
    upward = []
    for module, targets in graph().items():
        for target, line in targets:
            if LAYERS.index(layer(target)) < LAYERS.index(layer(module)):
                upward.append(f"{module}:{line} imports {target}")
    assert not upward, "\n".join(upward)


def test_no_import_circle_between_modules() -> None:
    edges = {m: {t for t, _ in targets} for m, targets in graph().items()}
    assert not cycles(edges)


def test_no_import_circle_between_layers() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph().items():
        for target, _ in targets:
            if layer(target) != layer(module):
                edges[layer(module)].add(layer(target))
    assert not cycles(edges)


def test_ranks_and_zygote_import_neither_the_driver_nor_the_controller() -> None:
    wrong = [
        f"{module}:{line} imports {target}"
        for module, targets in graph().items()
        if layer(module) in ("zygote", "ranks")
        for target, line in targets
        if layer(target) in ("driver", "controller", "report", "top")
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", sorted(PURE))
def test_pure_modules_import_no_torch_pytest_or_xdist(module: str) -> None:
    tree = modules()[module]
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in HEAVY]


def test_no_module_reads_another_modules_private_names() -> None:
    """`from .x import _y`, or `x._y` where `x` is a module of ours imported by name."""
    trees = modules()
    known = set(trees)
    wrong = []
    for module, tree in trees.items():
        bound: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        if node.level or (node.module or "").startswith(NAME):
                            wrong.append(f"{module}:{node.lineno} imports {alias.name}")
                    bound.add(alias.asname or alias.name)
        ours = {name for name in bound if any(m.endswith("." + name) for m in known)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                private = node.attr.startswith("_") and not node.attr.startswith("__")
                if private and node.value.id in ours:
                    wrong.append(f"{module}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_plugin_holds_hooks_only() -> None:
    """plugin.py defines pytest hooks, and helpers of its own that no other module uses."""
    tree = modules()[f"{NAME}.plugin"]
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert not classes
    assert [f for f in functions if not f.startswith(("pytest_", "_"))] == []
    assert len((PACKAGE / "plugin.py").read_text().splitlines()) <= 300


def test_only_roles_asks_which_process_this_is() -> None:
    """Each process decides its role once, in roles.py: no other module reads the variables
    that say how the process was started, or asks its config whether xdist made it a worker."""
    tells = ("XDIST_WORKER_VAR", "TORCHRUN_VARS", 'hasattr(config, "workerinput")')
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("roles.py", "protocol.py"):  # protocol defines the names roles reads
            continue
        text = path.read_text().replace("self.config", "config")
        assert not [tell for tell in tells if tell in text], path
