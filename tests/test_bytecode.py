"""With bytecode writing off (PYTHONDONTWRITEBYTECODE, common in CI images), the session's
processes share what one of them compiled, in a folder of the session's that is gone after it;
nothing is written beside the sources, and the tests' environment is left as the user set it."""

from __future__ import annotations

import os

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
