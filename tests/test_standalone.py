"""End to end: the Gang context manager from a plain Python script, without pytest."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import assert_no_processes_left, processes_tagged

SCRIPT = """
import json
import sys

import xdist_megatron
from helper_fns import add

def local(a, b):
    info = xdist_megatron.rank_info()
    return [info.rank, info.world_size, a * b]

def fail_on_rank_one():
    if xdist_megatron.rank_info().rank == 1:
        raise ValueError("rank one says no")

if __name__ == "__main__":
    with xdist_megatron.Gang(world_size=2) as gang:
        results = {"main": gang.run(local, 3, b=4), "module": gang.run(add, 1, 2)}
        try:
            gang.run(fail_on_rank_one)
        except xdist_megatron.GangError as exc:
            results["error"] = str(exc)
    print("RESULT " + json.dumps(results), flush=True)
    sys.stdin.readline()  # stay alive while the test looks for leftover processes
"""

HELPER = """
import xdist_megatron

def add(a, b):
    return [xdist_megatron.rank_info().rank, a + b]
"""


def read_result(proc: subprocess.Popen) -> dict:
    """The script's RESULT line (ranks and the zygote share its stdout, so skip their lines)."""
    for line in proc.stdout:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"the script ended without a result: {proc.communicate()[1]}")


@pytest.mark.timeout(120)
def test_gang_from_a_script(pytester, tag):
    """Gang(world_size=2) runs functions from __main__ and from a module, in rank order; a
    failing call raises GangError naming the rank; leaving the `with` leaves no process behind."""
    pytester.makepyfile(standalone=SCRIPT, helper_fns=HELPER)
    proc = subprocess.Popen(
        [sys.executable, "standalone.py"],
        cwd=pytester.path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        results = read_result(proc)
        assert processes_tagged(tag) == [proc.pid], "a rank or the zygote outlived the gang"
        proc.communicate("\n", timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert results["main"] == [[0, 2, 12], [1, 2, 12]]
    assert results["module"] == [[0, 3], [1, 3]]
    assert "fail_on_rank_one failed on rank(s) 1: ValueError: rank one says no" in results["error"]
    assert_no_processes_left(tag)
