"""What pytest's failure reports learn from parsing a source text, learnt once per process.

pytest parses a file's whole source again for every traceback entry of every failure it formats
(`getstatementrange_ast`, to find the statement around a line; its own cache lasts one
traceback). A suite whose tests fail deep inside a large library spends more time formatting than
testing: Megatron-LM's unit suite at world size 1 fails ~1,400 tests, most through the same lines
of megatron-core files of 2,000-4,000 lines, and on its `dist_checkpointing` tests (CPU) the
formatting was half of a 30 s test phase. Each process of a session (driver, xdist worker, rank)
keeps the statement range of every line it looked up, so a text is parsed again only for a line
it has not seen. It keeps ranges, not trees: a tree of such a file is tens of thousands of
objects that every garbage collection scans, and a rank collects after every test. The reports
stay the same, character for character.
"""

from __future__ import annotations

import ast
import functools
from collections import OrderedDict
from collections.abc import Callable

import _pytest._code.code as pytest_code
import _pytest._code.source as pytest_source

MODULES = (pytest_code, pytest_source)  # each calls the function by its own global name
KEPT = 64  # source texts whose ranges a process keeps (a text is one string: the gc skips it)
# Returned where the range was known without a tree: pytest keeps what it gets for the rest of
# one traceback only, to hand it back here.
NO_TREE = ast.Module(body=[], type_ignores=[])

Range = tuple[int, int]


def install() -> Callable[[], None] | None:
    """Have pytest's tracebacks reuse statement ranges; returns what undoes it (None: nothing was
    done, as pytest lacks the function, or another session of this process installed it).
    Only pytest's own function is replaced."""
    plain = getattr(pytest_source, "getstatementrange_ast", None)
    ours = getattr(plain, "reuses_ranges", False)
    if plain is None or ours or getattr(pytest_code, "getstatementrange_ast", None) is not plain:
        return None  # missing, installed already, or another plugin's
    ranges: OrderedDict[str, dict[tuple[int, bool], Range]] = OrderedDict()

    @functools.wraps(plain)  # its name and doc, and `__wrapped__`: pytest's own
    def statement_range(
        lineno: int, source: object, assertion: bool = False, astnode: ast.AST | None = None
    ) -> tuple[ast.AST, int, int]:
        text = str(source)
        known = ranges.setdefault(text, {})
        ranges.move_to_end(text)
        if len(ranges) > KEPT:
            ranges.popitem(last=False)
        found = known.get((lineno, assertion))
        if found is not None:
            return (NO_TREE if astnode is None else astnode), *found
        tree = None if astnode is NO_TREE else astnode
        tree, start, end = plain(lineno, source, assertion, tree)  # a SyntaxError goes on
        known[lineno, assertion] = start, end
        return tree, start, end

    statement_range.reuses_ranges = True  # type: ignore[attr-defined]
    for module in MODULES:
        module.getstatementrange_ast = statement_range

    def uninstall() -> None:
        for module in MODULES:
            module.getstatementrange_ast = plain

    return uninstall
