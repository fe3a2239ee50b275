"""Shared helpers: run pytest on generated suites in a subprocess and prove nothing is left over."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Generator
from pathlib import Path

import pytest
import torch  # noqa: F401 - see below

# Imported before any test: pytester drops the modules a test imported first when it ends, and
# torch's C extension cannot be initialised twice in one process (a later `import torch` there
# fails with "SystemError: ... bad call flags"). Runs of a few test files under -n hit it.
pytest_plugins = ["pytester"]

# The scheduler's simulator lives with the benchmarks, which these tests share with it. Last on
# the path: bench/ also holds scripts named like packages (coverage.py).
sys.path.append(str(Path(__file__).parents[1] / "bench"))


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C must reach the runs this suite starts, as it does from a terminal. A launcher
    without job control (`bash .ci/run &` in a script) starts the suite with SIGINT ignored, its
    runs inherit that, and every interrupt test then fails with nothing interrupted. A handled
    signal is reset to the default in a child, an ignored one is not: so handle it here."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers", "alone: times itself; under -n no other test of this suite runs beside it"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator:
    """Under `pytest -n`, a test marked `alone` waits for the tests running beside it and holds
    the others back until it ends (the deadlines of a test that times a rank's death or an
    interrupt are for an otherwise idle machine); the rest run side by side."""
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:
        return (yield)
    folder = Path(tempfile.gettempdir()) / f"xdist-megatron-tests-{workerinput['testrunuid']}"
    folder.mkdir(exist_ok=True)
    with _turn(folder, alone=item.get_closest_marker("alone") is not None):
        return (yield)


@contextlib.contextmanager
def _turn(folder: Path, alone: bool) -> Generator[None, None, None]:
    """A readers-writer lock of two flocks: `gate` lets a waiting `alone` test go before tests
    that come after it; `running` is shared by ordinary tests, held alone by an `alone` one."""
    with open(folder / "gate", "a") as gate, open(folder / "running", "a") as running:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)


TAG_VAR = "XDIST_MEGATRON_TEST_TAG"
TORCHRUN_VARS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
}


# For generated suites: the zygotes among a process's children (a driver's, a controller's).
ZYGOTES_OF = """
def zygotes_of(pid):
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                command = f.read()
        except OSError:
            continue
        if parent == pid and "xdist_megatron.zygote" in command:
            found.append(int(entry))
    return found
"""


def start_from_a_plain_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs this test starts see no rank's, worker's or torchrun's variables (this suite may
    itself run on one), but keep the test's tag."""
    for name in list(os.environ):
        if name in TORCHRUN_VARS or name.startswith(("XDIST_MEGATRON_", "PYTEST_XDIST_")):
            if name != TAG_VAR:
                monkeypatch.delenv(name)


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def assert_gone(pids: set[int], within: float = 5.0) -> None:
    """Wait for `pids` to end (an exiting process lingers briefly after its children went)."""
    deadline = time.monotonic() + within
    while left := [pid for pid in pids if alive(pid)]:
        assert time.monotonic() < deadline, f"still running: {left}"
        time.sleep(0.05)


def processes_tagged(tag: str) -> list[int]:
    """Live processes whose environment carries `tag` (ranks and zygotes inherit it)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(int(entry)):
            found.append(int(entry))
    return found


def assert_no_processes_left(tag: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        left = processes_tagged(tag)
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes left behind: {left}")
        time.sleep(0.1)


def torchrun_pytest(pytester: pytest.Pytester, expect_rc: int) -> str:
    """`torchrun --nproc-per-node 2 -m pytest` on pytester's folder; both ranks' output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
               "pytest", "-p", "no:cacheprovider", "-rs", str(pytester.path)]  # fmt: skip
    done = subprocess.run(command, cwd=pytester.path, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == expect_rc, output
    return output


@pytest.fixture
def tag(monkeypatch: pytest.MonkeyPatch) -> str:
    """A unique tag in the environment of every process the test starts."""
    value = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, value)
    return value


@pytest.fixture
def run_pytest(
    pytester: pytest.Pytester, tag: str, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., pytest.RunResult]:
    """Run pytest in a subprocess on the pytester folder; then assert no rank or zygote is left.

    The run sees no GPU unless `gpus=True`: the suite's expectations are CPU mode's, also when
    it runs on a machine with GPUs. It has no pytest cache unless `cache=True`. `env` is set
    in its environment after the plain shell's."""

    def run(
        *args: str,
        timeout: float = 300,
        gpus: bool = False,
        cache: bool = False,
        env: dict[str, str] | None = None,
    ) -> pytest.RunResult:
        start_from_a_plain_shell(monkeypatch)  # this suite may itself run under xdist
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        if not gpus:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        no_cache = () if cache else ("-p", "no:cacheprovider")
        result = pytester.runpytest_subprocess(*no_cache, *args, timeout=timeout)
        assert_no_processes_left(tag)
        return result

    return run
