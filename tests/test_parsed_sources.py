"""Failure reports parse each source text once per process where their lines repeat
(parsed_sources.py), say what they said before, and leave no tree behind for the ranks' per-test
garbage collection to scan: in the driver and on the ranks of a gang, end to end."""

from __future__ import annotations

import ast
import json
import re

from xdist_megatron import parsed_sources

HELPER = """
def check(values):
    total = 0
    for value in values:
        total += value
    assert total == -1, f"total {total}"
"""

FAILING = """
import pytest

from helper import check

{mark}

@pytest.mark.parametrize("n", range(4))
def test_fails_in_the_helper(n):
    check(list(range(n)))
"""

# Counts pytest's parses of whole source texts (`getstatementrange_ast` names them "source") in
# each process, written after every report, so the last report of a process leaves its counts.
COUNTING_CONFTEST = """
import ast
import json
import os

import pytest

plain_parse = ast.parse
parses = {}


def counting_parse(source, filename="<unknown>", *args, **kwargs):
    if filename == "source":
        parses[source] = parses.get(source, 0) + 1
    return plain_parse(source, filename, *args, **kwargs)


ast.parse = counting_parse


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.excinfo is not None:
        str(report.longrepr)  # formatted here, as the rank does before sending it
    folder = os.environ["PARSES_DIR"]
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as file:
        json.dump(sorted(parses.values()), file)
    return report
"""


def failures_section(text: str) -> str:
    """The FAILURES part of a terminal report, without its timings."""
    section = text.split("= FAILURES =", 1)[1].split("short test summary info", 1)[0]
    return re.sub(r"\d+\.\d+s", "", section)


def test_each_source_text_is_parsed_once_per_process(pytester, run_pytest, monkeypatch) -> None:
    """Four failures through one helper, unmarked and on a gang of 2: every process parses each
    text it formats once (pytest alone: once per failure), and the unmarked failures read as
    they do without the plugin."""
    parses = pytester.mkdir("parses")
    monkeypatch.setenv("PARSES_DIR", str(parses))
    pytester.makeconftest(COUNTING_CONFTEST)
    pytester.makepyfile(
        helper=HELPER,
        test_plain=FAILING.format(mark=""),
        test_gang=FAILING.format(mark="pytestmark = pytest.mark.world_size(2)"),
    )
    result = run_pytest("--tb=long", "--megatron-timeout", "60")
    result.assert_outcomes(failed=8)
    counts = {path.stem: json.loads(path.read_text()) for path in parses.iterdir()}
    assert len(counts) >= 3, counts  # the driver and the two ranks
    assert all(count == 1 for values in counts.values() for count in values), counts

    for path in parses.iterdir():
        path.unlink()
    plugin = run_pytest("--tb=long", "test_plain.py")
    plain = run_pytest("--tb=long", "-p", "no:xdist_megatron.plugin", "test_plain.py")
    assert failures_section(plugin.stdout.str()) == failures_section(plain.stdout.str())
    counts = {path.stem: json.loads(path.read_text()) for path in parses.iterdir()}
    assert max(count for values in counts.values() for count in values) > 1  # pytest alone


# Counts the syntax trees alive on a rank when each test starts, after the last test's cleanup.
TREES_CONFTEST = """
import ast
import gc
import os

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.excinfo is not None:
        str(report.longrepr)  # formatted here, as the rank does before sending it
    return report


def pytest_runtest_setup(item):
    gc.collect()
    trees = sum(isinstance(thing, ast.AST) for thing in gc.get_objects())
    with open(os.path.join(os.environ["TREES_DIR"], f"{os.getpid()}.txt"), "a") as file:
        file.write(f"{trees}\\n")
"""


def test_failure_reports_leave_no_tree_for_the_collector(pytester, run_pytest, monkeypatch) -> None:
    """Four failures through one helper on a gang of 2: what a rank keeps of the parsed sources
    is no syntax tree (tens of thousands of objects for a large file, which the collection after
    every test would scan again), so no tree is alive when the next test starts."""
    trees = pytester.mkdir("trees")
    monkeypatch.setenv("TREES_DIR", str(trees))
    pytester.makeconftest(TREES_CONFTEST)
    pytester.makepyfile(
        helper=HELPER, test_gang=FAILING.format(mark="pytestmark = pytest.mark.world_size(2)")
    )
    run_pytest("--tb=long", "--megatron-timeout", "60").assert_outcomes(failed=4)
    counts = {path.stem: path.read_text().split() for path in trees.iterdir()}
    assert len(counts) == 2, counts  # the two ranks
    assert all(count == "0" for values in counts.values() for count in values), counts


def test_ranges_reused_installed_once_and_undone(monkeypatch) -> None:
    """A line looked up before is answered without a parse, whatever Source holds the text; a new
    line of the same text gets pytest's own answer; a second session in the process (pytester's
    in-process runs) installs nothing more; undoing gives pytest its own function back."""
    import _pytest._code.code as pytest_code
    import _pytest._code.source as pytest_source
    from _pytest._code.source import Source

    installed = pytest_source.getstatementrange_ast  # this session's plugin has installed it
    getstatementrange_ast = getattr(installed, "__wrapped__", installed)

    for module in parsed_sources.MODULES:  # as before any session installed it
        monkeypatch.setattr(module, "getstatementrange_ast", getstatementrange_ast)
    undo = parsed_sources.install()
    assert undo is not None and pytest_code.getstatementrange_ast.reuses_ranges
    tree, start, end = pytest_code.getstatementrange_ast(5, Source(HELPER))
    assert isinstance(tree, ast.Module) and tree is not parsed_sources.NO_TREE
    assert (start, end) == getstatementrange_ast(5, Source(HELPER))[1:]
    again = pytest_code.getstatementrange_ast(5, Source(HELPER))
    assert again == (parsed_sources.NO_TREE, start, end)  # no parse
    assert pytest_code.getstatementrange_ast(5, Source(HELPER), astnode=tree)[0] is tree
    # New lines: with the stand-in that pytest hands back within a traceback, and with nothing
    for lineno, astnode in ((3, parsed_sources.NO_TREE), (4, None)):
        found = pytest_code.getstatementrange_ast(lineno, Source(HELPER), astnode=astnode)
        assert found[1:] == getstatementrange_ast(lineno, Source(HELPER))[1:]
    assert parsed_sources.install() is None
    undo()
    assert pytest_code.getstatementrange_ast is getstatementrange_ast
    assert pytest_source.getstatementrange_ast is getstatementrange_ast
