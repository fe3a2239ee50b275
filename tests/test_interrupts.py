"""Real signals at the moments the run is most fragile, serially and under `--dist megatron`.

Ctrl-C (SIGINT to pytest's process group, as a terminal sends it) ends the run as pytest ends
an interrupted one, wherever it lands: its KeyboardInterrupt summary, exit code 2, and no zygote
or rank left 5 s after the signal. SIGKILL of an xdist worker is reported as that worker's crash,
with how its gang's ranks ended after the headline.

Each run is pytest in a process group of its own; what it starts carries the test's tag, so
whatever is left over is found (and killed, by pid) after a failure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import assert_no_processes_left, processes_tagged, start_from_a_plain_shell

GONE_WITHIN = 5.0  # the contract: no rank or zygote 5 s after the interrupt
SUMMARY = re.compile(r"^!+ KeyboardInterrupt.* !+$", re.MULTILINE)  # pytest's, at the end
XDIST = ("-n", "2", "--dist", "megatron")

# A library the driver or the zygote imports slowly: it says so, then takes 30 s. The
# swallowing one drops the KeyboardInterrupt, as torch's C extension drops any error while it
# imports numpy (where a Ctrl-C in the first second of a run tends to land).
SLOW_LIBRARY = """
import os, time
open(os.path.join(os.environ["FACTS_DIR"], f"importing-{os.getpid()}"), "w").close()
deadline = time.monotonic() + 30
try:
    while time.monotonic() < deadline:
        time.sleep(0.05)
except KeyboardInterrupt:
    if not SWALLOWS:
        raise
"""

# Driver-side facts: a test started in a driver (not on a rank), an xdist worker's pid.
FACTS_CONFTEST = """
import os

def _fact(name, text=""):
    with open(os.path.join(os.environ["FACTS_DIR"], name), "w") as f:
        f.write(text)

def pytest_configure(config):
    if hasattr(config, "workerinput"):
        _fact(f"worker-{config.workerinput['workerid']}", str(os.getpid()))

def pytest_runtest_logstart(nodeid):
    if "XDIST_MEGATRON_ZYGOTE" not in os.environ:
        _fact("logstart")
"""

GANG_TEST = """
import os, time
import pytest

@pytest.mark.world_size(2)
def test_on_gang(rank):
    with open(os.path.join(os.environ["FACTS_DIR"], f"body-{rank}"), "w") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', '')} {os.getpid()}")
    time.sleep(BODY_SECONDS)
"""


def gang_processes(tag: str) -> list[int]:
    """The run's zygote and ranks (ranks are forks of the zygote: the same command line)."""
    found = []
    for pid in processes_tagged(tag):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"xdist_megatron.ranks.zygote" in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def wait_for(ready: Callable[[], bool], process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"never saw {what}:\n{stop(process)}")
        time.sleep(0.05)


def stop(process: subprocess.Popen) -> str:
    """End a run this test started (its process group) and return its output."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    return process.communicate()[0]


class Run:
    """pytest on the pytester folder, in a process group of its own, as a terminal runs it."""

    def __init__(self, pytester: pytest.Pytester, facts: Path, tag: str, args: tuple) -> None:
        self.facts = facts
        self.tag = tag
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
        self.process = subprocess.Popen(
            command,
            cwd=pytester.path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def has(self, *names: str) -> bool:
        return all((self.facts / name).exists() for name in names)

    def ctrl_c_once(self, *facts: str) -> float:
        """SIGINT to the run's process group once `facts` exist; when it was sent."""
        wait_for(lambda: self.has(*facts), self.process, ", ".join(facts))
        os.killpg(self.process.pid, signal.SIGINT)
        return time.monotonic()

    def finish(self) -> str:
        try:
            return self.process.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            return stop(self.process) + "\n[the run did not end within 60 s]"

    def kill_leftovers(self) -> None:
        """Whatever the run left (a failure here): its processes carry our tag."""
        stop(self.process)
        for pid in processes_tagged(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def facts(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = pytester.mkdir("facts")
    monkeypatch.setenv("FACTS_DIR", str(folder))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU mode, as run_pytest's runs
    start_from_a_plain_shell(monkeypatch)
    return folder


@pytest.fixture
def libraries(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """slow_lib and swallowing_lib, installed outside the project (so the zygote preloads them)."""
    folder = tmp_path_factory.mktemp("libraries")
    (folder / "slow_lib.py").write_text(SLOW_LIBRARY.replace("SWALLOWS", "False"))
    (folder / "swallowing_lib.py").write_text(SLOW_LIBRARY.replace("SWALLOWS", "True"))
    monkeypatch.setenv("PYTHONPATH", str(folder), prepend=os.pathsep)
    return folder


@pytest.fixture
def start(pytester: pytest.Pytester, facts: Path, tag: str) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def run(*args: str) -> Run:
        runs.append(Run(pytester, facts, tag, args))
        return runs[-1]

    yield run
    for started in runs:
        started.kill_leftovers()


def assert_interrupted(run: Run, signalled: float, facts: Path, body_ran: bool) -> None:
    """No zygote or rank 5 s after the signal; pytest's interrupt summary and exit code 2;
    the test body ran only where the signal came during it; nothing else is left either."""
    while (left := gang_processes(run.tag)) and time.monotonic() < signalled + GONE_WITHIN:
        time.sleep(0.05)
    output = run.finish()
    assert not left, f"zygote or ranks still there {GONE_WITHIN:g} s after Ctrl-C:\n{output}"
    assert run.process.returncode == 2, output
    assert SUMMARY.search(output), output
    assert bool(list(facts.glob("body-*"))) == body_ran, output
    assert_no_processes_left(run.tag, within=15)


MODES = pytest.mark.parametrize("mode", [(), XDIST], ids=["serial", "xdist"])


@MODES
@pytest.mark.parametrize("library", ["slow_lib", "swallowing_lib"])
def test_ctrl_c_while_the_conftest_imports(pytester, facts, libraries, start, mode, library):
    """Ctrl-C while a conftest file imports a library, the zygote already following those
    imports (it started with torch, and imports the library as well): pytest's interrupt ends
    the run, also when the library swallowed the KeyboardInterrupt (the run went on into the
    tests), and the zygote busy importing does not outlive it (it did, by its import)."""
    pytester.makeconftest(f"import torch\nimport {library}\n")
    pytester.makepyfile(test_gang=GANG_TEST.replace("BODY_SECONDS", "0"))
    run = start(*mode)
    signalled = run.ctrl_c_once(f"importing-{run.process.pid}")
    assert_interrupted(run, signalled, facts, body_ran=False)


@MODES
def test_ctrl_c_before_the_zygote_answers(pytester, facts, libraries, start, mode):
    """The first test waits for the zygote, still importing a slow preload: Ctrl-C kills it at
    once (the driver used to ask it to leave, which it reads only after its imports, and wait
    5 s before killing it)."""
    pytester.makeini("[pytest]\nmegatron_preload = slow_lib\n")
    pytester.makeconftest(FACTS_CONFTEST)
    pytester.makepyfile(test_gang=GANG_TEST.replace("BODY_SECONDS", "0"))
    run = start(*mode)
    signalled = run.ctrl_c_once("logstart")
    assert_interrupted(run, signalled, facts, body_ran=False)


@MODES
def test_ctrl_c_during_a_test_on_a_gang(pytester, facts, start, mode):
    pytester.makeconftest(FACTS_CONFTEST)
    pytester.makepyfile(test_gang=GANG_TEST.replace("BODY_SECONDS", "600"))
    run = start(*mode)
    signalled = run.ctrl_c_once("body-0", "body-1")
    assert_interrupted(run, signalled, facts, body_ran=True)


def test_a_killed_worker_is_named_before_its_ranks(pytester, facts, start, tag):
    """SIGKILL of the xdist worker whose gang runs a test: the report's headline is xdist's
    (the worker crashed while running it), and how the gang's ranks ended follows it (only the
    shared zygote saw that: it ended them when the worker's connection closed)."""
    pytester.makeconftest(FACTS_CONFTEST)
    pytester.makepyfile(test_gang=GANG_TEST.replace("BODY_SECONDS", "600"))
    run = start(*XDIST, "--megatron-timeout", "300")
    wait_for(lambda: run.has("body-0", "body-1"), run.process, "the test on the gang")
    bodies = [(facts / f"body-{rank}").read_text().split() for rank in (0, 1)]
    worker, ranks = bodies[0][0], {int(pid) for _, pid in bodies}
    os.kill(int((facts / f"worker-{worker}").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    while (left := ranks & set(gang_processes(tag))) and time.monotonic() < killed + GONE_WITHIN:
        time.sleep(0.05)
    output = run.finish()
    assert not left, f"ranks of the killed worker still there:\n{output}"
    assert run.process.returncode == 1, output
    lines = pytest.LineMatcher(output.splitlines())
    lines.fnmatch_lines(
        [
            f"worker '{worker}' crashed while running 'test_gang.py::test_on_gang'",
            "its gang of 2 ended with it:",
            "rank 0 was killed by signal SIGKILL (9)",
            "rank 1 was killed by signal SIGKILL (9)",
        ],
        consecutive=True,
    )
    lines.fnmatch_lines([f"FAILED test_gang.py::test_on_gang - worker '{worker}' crashed*"])
    assert_no_processes_left(tag, within=15)
