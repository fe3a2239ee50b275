"""What crosses between processes: the messages of driver, zygote and ranks (pickled over their
sockets), the environment variables, report attributes and xdist keys they share, the plain stash
keys, and the small helpers every layer uses on them (`module_of`, `write_json`).

The bottom of the package: it imports nothing of ours, and nothing heavy, since the zygote and the
ranks import it before any test code. Stash keys typed by one of our classes live with the class.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest

# --- environment variables ---------------------------------------------------------------------

# The package's folder: frames and stack lines under it are the plugin's, folded or cut from what
# a user is shown of a failure, a timeout or an interrupt.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# In the zygote's environment and its ranks': the zygote's pid (a rank knows it is one by it).
ZYGOTE_VAR = "XDIST_MEGATRON_ZYGOTE"
DEVICE_COUNT_VAR = "XDIST_MEGATRON_DEVICE_COUNT"  # the driver's, so ranks resolve "all" alike
DEVICES_VAR = "XDIST_MEGATRON_DEVICES"  # the gang's block of devices ("2,3"), on every rank
WORKER_VAR = "XDIST_MEGATRON_WORKER"  # an xdist worker's index, in its spec: replacements keep it
# On a worker whose CUDA view is its home GPU: the run's device count, for spawn harnesses
RUN_DEVICE_COUNT_VAR = "XDIST_MEGATRON_RUN_DEVICE_COUNT"
XDIST_WORKER_VAR = "PYTEST_XDIST_WORKER"  # set by xdist before a worker's config is made
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# A preload's failure where the ranks use GPUs: the driver remembers such modules (preload.py)
CUDA_AT_IMPORT = "initialised CUDA at import; forked ranks could not use the GPU"
LOCALHOST = "127.0.0.1"  # where the gangs' stores and rendezvous listen, and ports are probed

# --- xdist: the workerinput key, and the attribute a worker's report carries to the controller -

DIST_MODE = "megatron"  # --dist megatron
INPUT_KEY = "xdist_megatron"  # node.workerinput[INPUT_KEY]: the worker's index, devices, folders
SPAN_ATTRIBUTE = "megatron_span"  # on a teardown report: where and when the test ran

# --- stash keys of plain values ----------------------------------------------------------------

WORLD_SIZE = pytest.StashKey[int]()  # an item's world size, where it runs on ranks
HARNESS = pytest.StashKey[str]()  # an item's spawn harness: its parent's side stays in the driver
WHOLE_CLASS = pytest.StashKey[bool]()  # its class's tests run on one worker, never split
GANGS_AT_CALL = pytest.StashKey[bool]()  # on a config: a test body may ask for a gang at its call
LAYOUT = pytest.StashKey[tuple]()  # an item's Megatron layout, where it has the marker
TIMEOUT = pytest.StashKey[float]()  # pytest-timeout's timeout of an item that runs on a gang
ITEMS = pytest.StashKey[list]()  # the session's collected items, kept by the config
# on a config: end this process's gangs and zygotes at once (Ctrl-C), whatever its role
CLOSE_NOW = pytest.StashKey[Callable[[], None]]()


def module_of(nodeid: str) -> str:
    """The module part of a node id: what tests of one module share, on gangs and in units."""
    return nodeid.split("::")[0]


def write_json(path: Path, data: object, indent: int | None = None) -> None:
    """Write atomically: readers (a worker, the controller, another CI job) see the old file or
    the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=indent)
        f.write("\n")
    os.replace(tmp, path)


# --- driver <-> rank (pickled over one socket per rank) ----------------------------------------


class RankInfo(NamedTuple):
    """Where the calling code runs: returned by `xdist_megatron.rank_info()`."""

    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device


@dataclass(frozen=True)
class CoverageTarget:
    """Where a measured driver wants the coverage of its zygote's and ranks' code: measured with
    its own configuration (coverage's serialized form) and published into its store folder."""

    config: str
    store: str


@dataclass(frozen=True)
class RankSpec:
    """What the zygote needs to turn a fork into rank `rank` of a gang."""

    rank: int
    world_size: int
    env: dict[str, str]
    backend: str
    store_host: str
    store_port: int
    use_cuda: bool
    driver_pid: int
    stack_path: str
    start_timeout: float
    coverage: CoverageTarget | None = None  # measure this rank (the driver measures itself)
    threads: int | None = None  # torch's intra-op threads; None: torch's default


@dataclass(frozen=True)
class SessionArgs:
    """What a rank needs to build the driver's pytest session again."""

    args: list[str]
    invocation_dir: str
    sys_path: list[str]
    basetemp: str  # the folder in which each rank makes its own basetemp and cache
    extra: tuple[str, ...] = ()  # arguments only the ranks get (plugins that write files)


@dataclass(frozen=True)
class TestJob:
    """Run one test's whole pytest protocol on a rank, in the rank's own pytest session."""

    nodeid: str
    module_path: str  # collected on the rank on its first test there
    next_nodeid: str | None  # the next test this gang runs, if known: pytest's nextitem
    session: SessionArgs
    capture: bool  # capture the rank's fds during the job (off with -s)


@dataclass(frozen=True)
class CallJob:
    """Call a pickled (fn, args, kwargs) on a rank: `gang.run` and the standalone Gang."""

    payload: bytes
    sys_path: list[str] = field(default_factory=list)
    main_path: str | None = None  # the driver's __main__ script, for functions defined there


@dataclass(frozen=True)
class CleanupJob:
    """The per-job cleanup, for jobs that did not run it themselves (explicit gang style)."""


@dataclass(frozen=True)
class ResetJob:
    """Module boundary: end the scopes the last module kept, then restore the state each rank
    recorded right after it started."""

    next_nodeid: str | None = None  # the test that comes next: scopes it shares stay


@dataclass(frozen=True)
class ShutdownJob:
    """End the rank's pytest session (session-scoped fixtures), leave the process group, exit."""


Job = TestJob | CallJob | CleanupJob | ResetJob | ShutdownJob

PASSED, FAILED = "passed", "failed"
RAISED = "raised"  # a `gang.run` function raised: an ordinary failure, the rank stays fit
DIED, STUCK, WAITED = "died", "stuck", "waited"


@dataclass
class RankResult:
    """What one rank reports for one job."""

    rank: int
    outcome: str  # PASSED; RAISED: a `gang.run` function raised, the rank is fit for the next
    # job; FAILED: the job failed, or the rank is not fit for the next one
    message: str = ""  # one line: the exception
    longrepr: Any = None  # pytest's failure representation (or text) for failures
    crash: tuple[str, int] | None = None  # (path, lineno) of the failure
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0
    value: Any = None  # CallJob return value
    reports: list[dict] = field(default_factory=list)  # a TestJob's serialised pytest reports
    note: str = ""  # what the rank repaired after the job (a warning of the test)
    lost: str = ""  # DIED, STUCK or WAITED (done, waited for peers): a rank that did not report
    warnings: list[dict] = field(default_factory=list)  # warnings the test raised on the rank
    gpu_used: int = 0  # bytes in use on the rank's GPU, every process's, as the job ended


@dataclass(frozen=True)
class PhaseReport:
    """One serialised pytest report of a TestJob, sent as soon as the rank's runner made it."""

    rank: int
    data: dict


@dataclass(frozen=True)
class AtFinishLine:
    """A rank is done with its test (its fixtures torn down) and waits for its peers."""

    rank: int


@dataclass(frozen=True)
class Ready:
    """First message of a rank: it joined the process group."""

    rank: int
    pid: int


# --- driver <-> zygote (pickled over the driver's zygote connection) -----------------------------


@dataclass(frozen=True)
class ForkRanks:
    """Fork one rank per spec; the ranks' socket ends follow on the socket (SCM_RIGHTS)."""

    specs: list[RankSpec]


@dataclass(frozen=True)
class SignalRanks:
    """Signal ranks of this driver's that are still the zygote's children."""

    pids: list[int]
    signum: int


@dataclass(frozen=True)
class Preload:
    """Import these too (what is imported already is skipped); keep `standby` ranks forked."""

    modules: list[str]
    standby: int


@dataclass(frozen=True)
class Join:
    """A driver that shares the zygote names itself (its xdist worker id), so that the owner
    can learn how its ranks ended should it die (DriverLeft)."""

    name: str


@dataclass(frozen=True)
class Leave:
    """The driver is done: its ranks are killed; when the zygote's owner leaves, it exits."""


@dataclass(frozen=True)
class Preloaded:
    """A preload is done: modules that failed to import ({name: why}), and those that touched
    the CUDA driver (after which no fork of this zygote could use a GPU)."""

    failures: dict[str, str]
    breaks_cuda: list[str]
    pid: int


@dataclass(frozen=True)
class Forked:
    """The ranks' pids; none when an earlier preload touched CUDA (those modules, then)."""

    pids: list[int]
    breaks_cuda: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RankExited:
    pid: int
    code: int  # negative: killed by that signal


@dataclass(frozen=True, order=True)
class RankEnd:
    """How one rank of a driver that went away ended."""

    rank: int
    world_size: int
    code: int  # as RankExited's


def describe_exit(code: int | None) -> str:
    """'exited with code 3' / 'was killed by signal SIGKILL (9)' / 'closed its connection'."""
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "signal"
        return f"was killed by signal {name} ({-code})"
    return f"exited with code {code}"


@dataclass(frozen=True)
class DriverLeft:
    """To the owner: a named driver's connection closed while it had ranks (it crashed), and
    the zygote ended them so."""

    name: str
    ranks: list[RankEnd]


# --- driver -> controller (on a test's report) -------------------------------------------------


@dataclass(frozen=True)
class GangEvent:
    """A gang started or retired, and why."""

    time: float  # seconds since the epoch
    kind: str  # "start" or "retire"
    world_size: int
    gang: str  # e.g. "gw0:ws2#1": worker, world size, the n-th gang of that size there
    cause: str
