"""One parse of each source text per process for pytest's failure reports.

pytest parses a file's whole source again for every traceback entry of every failure it formats
(`getstatementrange_ast`; its own cache lasts one traceback). A suite whose tests fail deep inside
a large library spends more time formatting than testing: Megatron-LM's unit suite at world size 1
fails ~1,400 tests, most through the same megatron-core files of 2,000-4,000 lines, and on its
`dist_checkpointing` tests (CPU) the formatting was half of a 30 s test phase. Each process of a
session (driver, xdist worker, rank) keeps the trees of the source texts it parsed last, so a
text is parsed once; the reports stay the same, character for character.
"""

from __future__ import annotations

import ast
import functools
from collections import OrderedDict
from collections.abc import Callable

import _pytest._code.code as pytest_code
import _pytest._code.source as pytest_source

MODULES = (pytest_code, pytest_source)  # each calls the function by its own global name
KEPT = 16  # trees kept per process: one is about 3 MiB for a 2,500-line file


def install() -> Callable[[], None] | None:
    """Have pytest's tracebacks reuse parsed sources; returns what undoes it (None: nothing was
    done, as pytest lacks the function, or another session of this process installed it).
    Only pytest's own function is replaced."""
    plain = getattr(pytest_source, "getstatementrange_ast", None)
    ours = getattr(plain, "reuses_trees", False)
    if plain is None or ours or getattr(pytest_code, "getstatementrange_ast", None) is not plain:
        return None  # missing, installed already, or another plugin's
    trees: OrderedDict[str, ast.AST] = OrderedDict()

    @functools.wraps(plain)  # its name and doc, and `__wrapped__`: pytest's own
    def statement_range(
        lineno: int, source: object, assertion: bool = False, astnode: ast.AST | None = None
    ) -> tuple[ast.AST, int, int]:
        if astnode is not None:
            return plain(lineno, source, assertion, astnode)
        text = str(source)
        tree = trees.get(text)
        if tree is not None:
            trees.move_to_end(text)
            return plain(lineno, source, assertion, tree)
        tree, start, end = plain(lineno, source, assertion)  # a SyntaxError goes on, as before
        trees[text] = tree
        if len(trees) > KEPT:
            trees.popitem(last=False)
        return tree, start, end

    statement_range.reuses_trees = True  # type: ignore[attr-defined]
    for module in MODULES:
        module.getstatementrange_ast = statement_range

    def uninstall() -> None:
        for module in MODULES:
            module.getstatementrange_ast = plain

    return uninstall
