"""With bytecode writing off (PYTHONDONTWRITEBYTECODE, common in CI images), the session's
processes share what one of them compiled, in a folder of the session's that is gone after it;
nothing is written beside the sources, and the tests' environment is left as the user set it."""

from __future__ import annotations

import os
import py_compile
import sys

import pytest

SUITE = """
import glob
import os
import sys

import local_helper
import pytest

@pytest.mark.world_size(2)
def test_reads_what_the_session_compiled(rank):
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"  # a test's subprocess writes nothing
    assert not sys.dont_write_bytecode and sys.pycache_prefix
    compiled = glob.glob(os.path.join(sys.pycache_prefix, "**", "*.pyc"), recursive=True)
    names = {{os.path.basename(path).split(".")[0] for path in compiled}}
    # compiled at collection, before this rank imported them: the rank read them
    assert {{"test_compiled", "local_helper"}} <= names, names
    with open(os.path.join({facts!r}, f"prefix-{{rank}}"), "w") as f:
        f.write(sys.pycache_prefix)
"""


@pytest.mark.parametrize("mode", ["serial", "xdist"])
def test_ranks_read_the_bytecode_the_session_compiled(pytester, run_pytest, monkeypatch, mode):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    facts = pytester.mkdir("facts")
    pytester.makepyfile(local_helper="VALUE = 1\n", test_compiled=SUITE.format(facts=str(facts)))
    xdist = ["-n", "2", "--dist", "megatron"] if mode == "xdist" else []
    result = run_pytest("--megatron-timeout", "60", *xdist)
    result.assert_outcomes(passed=1)
    prefixes = {path.read_text() for path in facts.iterdir()}
    assert len(prefixes) == 1, prefixes  # both ranks, one folder
    assert not any(pytester.path.rglob("*.pyc"))
    assert not any(map(os.path.exists, prefixes))  # removed at the end


INSTALLED = """
import glob
import os
import sys

import installed_helper
import stale_helper
import pytest


def in_prefix(name):
    return glob.glob(os.path.join(sys.pycache_prefix, "**", name + ".*.pyc"), recursive=True)


@pytest.mark.world_size(1)
def test_installed_bytecode_is_read_where_it_is_current():
    # what an installed package's __pycache__ holds: read, not compiled again into the prefix
    assert installed_helper.__cached__.startswith({pycache!r}), installed_helper.__cached__
    assert not in_prefix("installed_helper")
    # a source changed since its .pyc: compiled into the prefix, its old .pyc left as it was
    assert stale_helper.__cached__.startswith(sys.pycache_prefix)
    assert in_prefix("stale_helper")
"""


@pytest.mark.parametrize("mode", ["serial", "xdist"])
def test_installed_bytecode_is_still_read(pytester, run_pytest, monkeypatch, mode):
    """With the session's folder set as `sys.pycache_prefix`, Python alone would look for
    bytecode only there, and compile every installed module again, in every process."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    pytester.makepyfile(installed_helper="VALUE = 1\n", stale_helper="VALUE = 2\n")
    pycache = pytester.path / "__pycache__"
    for name in ("installed_helper", "stale_helper"):  # beside the source, as pip installs them
        pyc = pycache / f"{name}.{sys.implementation.cache_tag}.pyc"
        py_compile.compile(str(pytester.path / f"{name}.py"), str(pyc), doraise=True)
    stale = pytester.path / "stale_helper.py"
    stale.write_text("VALUE = 22\n")  # another size: its .pyc is out of date
    before = {path: path.read_bytes() for path in pytester.path.rglob("*.pyc")}
    assert len(before) == 2
    pytester.makepyfile(test_installed=INSTALLED.format(pycache=str(pycache)))
    xdist = ["-n", "2", "--dist", "megatron"] if mode == "xdist" else []
    result = run_pytest("--megatron-timeout", "60", *xdist)
    result.assert_outcomes(passed=1)
    assert {path: path.read_bytes() for path in pytester.path.rglob("*.pyc")} == before
