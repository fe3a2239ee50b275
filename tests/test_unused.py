"""A run that uses none of the plugin behaves as if it were not installed (DESIGN, invariant 6):
no process, thread or temporary folder started, nothing of pytest replaced, no atexit handler,
nothing written to the pytest cache, no header line. End to end: the same plain suite (its
conftest imports torch, as a torch project's does) runs with the plugin installed and with
`-p no:xdist_megatron.plugin`, serially and under `-n 2`, and what each process of the run saw
must be the same. A suite with gangs still gets its zygote before collection from its second
run on: the pytest cache's record of the last run says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ZYGOTES_OF

NO_PLUGIN = ("-p", "no:xdist_megatron.plugin")
# The driver's and the ranks' side, the controller's: imported only by a run that uses them.
HEAVY = ("xdist_megatron.driver.gang", "xdist_megatron.driver.pool", "xdist_megatron.ranks",
         "xdist_megatron.controller")  # fmt: skip

# What a process of the run sees, at its test (in the serial driver or an xdist worker) and at
# the end of its session (there and in the xdist controller), written to OBSERVATIONS.
OBSERVING_CONFTEST = """
import atexit
import gc
import json
import os
import sys
import tempfile
import threading

import _pytest._code.source
import torch  # noqa: F401 - a plain torch suite's conftest

TAGGED = f"XDIST_MEGATRON_TEST_TAG={os.environ['XDIST_MEGATRON_TEST_TAG']}".encode()
HEAVY = {heavy!r}


def read(pid, name):
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def parent(pid):
    return int(read(pid, "stat").rsplit(b")", 1)[1].split()[1])


def other_processes():
    # This run's processes but pytest's own: this one, its parents, xdist's workers (execnet
    # starts them as `python -u -c ...`, which start in their own time).
    mine = {os.getpid()}
    pid = os.getpid()
    while pid > 1:
        pid = parent(pid)
        mine.add(pid)
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            tagged = TAGGED in read(entry, "environ").split(b"\\0")
            command = read(entry, "cmdline").split(b"\\0")
        except OSError:
            continue
        if tagged and int(entry) not in mine and command[1:3] != [b"-u", b"-c"]:
            found.append(" ".join(part.decode() for part in command[:3]))
    return sorted(found)


def gc_freeze_at_exit():
    before = atexit._ncallbacks()
    atexit.unregister(gc.freeze)
    registered = atexit._ncallbacks() < before
    if registered:
        atexit.register(gc.freeze)
    return registered


def observe(moment):
    seen = {
        "processes": other_processes(),
        "threads": sorted(thread.name for thread in threading.enumerate()),
        "temporary folder": sorted(os.listdir(tempfile.gettempdir())),
        "statement ranges from": _pytest._code.source.getstatementrange_ast.__code__.co_filename,
        "gc.freeze at exit": gc_freeze_at_exit(),
        "plugin modules": sorted(m for m in sys.modules if m.startswith(HEAVY)),
    }
    name = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{moment}.json"
    with open(os.path.join(os.environ["OBSERVATIONS"], name), "w") as f:
        json.dump(seen, f, indent=1)


def pytest_sessionfinish(session):
    observe("end")
""".replace("{heavy!r}", repr(HEAVY))

PLAIN_TESTS = """
from conftest import observe

observe("collect")  # where the conftest's import of torch would have started the zygote


def test_observes():
    observe("test")


def test_plain():
    assert sum(range(4)) == 6
"""


def observed_run(
    pytester: pytest.Pytester, run_pytest, monkeypatch, name: str, *args: str
) -> tuple[pytest.RunResult, dict[str, list[dict]], list[str]]:
    """Run the suite; what each of its processes saw, and what is in its pytest cache after."""
    observations = pytester.mkdir(f"../{pytester.path.name}-seen-{name}")
    temporary = pytester.mkdir(f"../{pytester.path.name}-tmp-{name}")
    monkeypatch.setenv("OBSERVATIONS", str(observations))
    monkeypatch.setenv("TMPDIR", str(temporary))  # what the run creates there, alone
    cache = pytester.path / ".pytest_cache"
    result = run_pytest(*args, cache=True)
    seen: dict[str, list[dict]] = {}
    for path in sorted(observations.iterdir()):
        role, moment = path.stem.split("-")  # xdist's workers alike: which one ran a test varies
        key = f"{'main' if role == 'main' else 'worker'}-{moment}"
        seen.setdefault(key, []).append(json.loads(path.read_text()))
    written = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    shutil.rmtree(cache, ignore_errors=True)
    return result, seen, written


@pytest.mark.parametrize("mode", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_a_plain_suite_runs_as_without_the_plugin(pytester, run_pytest, monkeypatch, mode):
    """Serially (the pytest process would start the zygote as the conftest imports torch) and
    under xdist's load scheduling (controller and workers), every process of the plain suite's
    run sees what it sees with the plugin disabled."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this test may run in a worker
    pytester.makeconftest(OBSERVING_CONFTEST)
    pytester.makepyfile(test_plain=PLAIN_TESTS)
    installed, seen, written = observed_run(pytester, run_pytest, monkeypatch, "on", *mode)
    installed.assert_outcomes(passed=2)
    absent, seen_without, written_without = observed_run(
        pytester, run_pytest, monkeypatch, "off", *NO_PLUGIN, *mode
    )
    absent.assert_outcomes(passed=2)
    assert {"main-end", "worker-test" if mode else "main-test"} <= set(seen)
    assert seen == seen_without
    assert written == written_without  # no key of the plugin's in the pytest cache
    assert installed.parseoutcomes() == absent.parseoutcomes()  # and no warning of its own
    mentions = [line for line in installed.outlines if "xdist-megatron" in line]
    assert [line for line in mentions if not line.startswith("plugins:")] == []


MARKED_TESTS = f"""
import os
import time

import pytest


{ZYGOTES_OF}

def at_import():
    # Only the driver imports this module before its tests run; a rank has RANK set.
    deadline = time.monotonic() + (30 if os.environ.get("EXPECT_EARLY") else 0)
    while not zygotes_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return zygotes_of(os.getpid())


AT_IMPORT = None if "RANK" in os.environ else at_import()


def test_local():
    print("zygotes when the driver imported the tests:", AT_IMPORT)


@pytest.mark.world_size(2)
def test_on_gang(rank, world_size):
    assert world_size == 2
"""


def test_a_suite_with_gangs_starts_its_zygote_early_from_its_second_run(
    pytester, run_pytest, monkeypatch
):
    """The first run learns at collection that it has gangs (no option or ini says so): its
    zygote starts then, and it records the module in the pytest cache. The second run reads the
    record before its conftest files load and has its zygote while they import."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makeconftest("import torch  # noqa: F401\n")
    pytester.makepyfile(test_marked=MARKED_TESTS)
    first = run_pytest("-s", "--strict-markers", cache=True)
    first.assert_outcomes(passed=2)
    first.stdout.fnmatch_lines(["*zygotes when the driver imported the tests: []*"])
    record = pytester.path / ".pytest_cache" / "v" / "xdist_megatron" / "gang_modules"
    assert json.loads(record.read_text()) == ["test_marked.py"]
    monkeypatch.setenv("EXPECT_EARLY", "1")
    second = run_pytest("-s", "--strict-markers", cache=True)
    second.assert_outcomes(passed=2)
    second.stdout.fnmatch_lines(["*zygotes when the driver imported the tests: [[]*[0-9]*[]]*"])


def test_the_plain_part_of_a_suite_stays_untouched_after_its_part_with_gangs_ran(
    pytester, run_pytest, monkeypatch
):
    """The record names the modules with gangs: a run of another folder of the same suite
    (the same rootdir and cache) still uses none of the plugin, and writes nothing."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makeconftest(OBSERVING_CONFTEST)
    pytester.mkdir("dist").joinpath("test_marked.py").write_text(MARKED_TESTS)
    pytester.mkdir("unit").joinpath("test_plain.py").write_text(PLAIN_TESTS)
    monkeypatch.setenv("OBSERVATIONS", str(pytester.mkdir(f"../{pytester.path.name}-dist")))
    run_pytest("dist", cache=True).assert_outcomes(passed=2)
    cache = pytester.path / ".pytest_cache" / "v" / "xdist_megatron"
    before = {p.name: p.read_text() for p in cache.iterdir()}
    assert json.loads(before["gang_modules"]) == ["dist/test_marked.py"]
    observations = pytester.mkdir(f"../{pytester.path.name}-unit")
    monkeypatch.setenv("OBSERVATIONS", str(observations))
    run_pytest("unit", cache=True).assert_outcomes(passed=2)
    seen = json.loads((observations / "main-test.json").read_text())
    assert seen["processes"] == [] and seen["plugin modules"] == []
    assert not seen["gc.freeze at exit"]
    assert {p.name: p.read_text() for p in cache.iterdir()} == before


def test_an_unmarked_test_that_requests_a_rank_fixture_still_gets_it(pytester, run_pytest):
    """A test that requests `rank` or `world_size` uses the plugin, unmarked: the driver's
    values, as before (without the plugin it would find no such fixture)."""
    pytester.makepyfile(
        test_driver="""
def test_in_the_driver(rank, world_size, local_rank):
    assert (rank, world_size, local_rank) == (0, 1, 0)
"""
    )
    run_pytest().assert_outcomes(passed=1)


def test_importing_the_plugin_imports_neither_torch_nor_its_driver(tmp_path: Path) -> None:
    """pytest imports the plugin and the modules it lists in every run of the environment:
    they must stay cheap."""
    code = (
        "import importlib, sys, xdist_megatron.plugin as plugin\n"
        "for name in plugin.pytest_plugins: importlib.import_module(name)\n"
        "print(' '.join(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    imported = done.stdout.split()
    assert [name for name in imported if name.startswith(("torch", *HEAVY))] == []
