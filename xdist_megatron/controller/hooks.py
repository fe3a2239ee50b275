"""pytest-xdist integration: `--dist megatron`, `-n auto`, per-worker devices, the side channel.

Registered by plugin.py once the run is known to use the plugin. The `megatron` choice of
`--dist` is plugin.py's: it must be there before the command line is parsed, in every run.

PYTEST_DONT_REWRITE: it has no asserts, and may be imported before pytest registers it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from .. import placement, sidechannel
from ..ci import durations, selection
from ..coverage import rank_coverage
from ..devices import detect_devices, gangs_per_device
from ..harnesses import on_gangs
from ..protocol import (
    DIST_MODE,
    INPUT_KEY,
    LOCALHOST,
    RUN_DEVICE_COUNT_VAR,
    WORKER_VAR,
    RankEnd,
    describe_exit,
)
from ..roles import Role, role_of
from .runtime import CONTROLLER_RUNTIME
from .scheduler import MegatronScheduling

RANK_END_WAIT = 2.0  # seconds the controller waits to hear how a crashed worker's ranks ended
LAUNCHER = Path(__file__).with_name("worker_launcher.py")
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
PORT_FLOOR, PORT_TRIES = 10000, 100  # workers' MASTER_PORTs: from PORT_FLOOR up, not ephemeral
_draw = random.SystemRandom()  # not the global generator, which a plugin may have seeded

AUTO_SERIAL = pytest.StashKey[str]()  # why -n auto started no workers, for the report header
WORKER_INTERRUPTS = "xdist-megatron-worker-interrupts"


def requested(config: pytest.Config) -> bool:
    return config.getoption("dist", "no") == DIST_MODE


def pytest_configure(config: pytest.Config) -> None:
    if requested(config) and role_of(config) is Role.CONTROLLER:
        config.pluginmanager.register(WorkerInterrupts(), WORKER_INTERRUPTS)


class WorkerInterrupts:
    """The controller's: a Ctrl-C that reached the controller alone (a CI runner's SIGINT to
    its pid) is passed on to its workers, as a terminal's reaches the whole process group, and
    before the controller's own interrupt kills the shared zygote. Without it each worker,
    forked from the zygote into a process group of its own, ran on into its next test (on a
    zygote of its own) until xdist's shutdown gave up waiting for it and execnet interrupted it
    5 s later; a launcher still waiting for its fork started its worker as plain python once
    the zygote was gone."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self) -> None:
        for pid in started_by_execnet():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)


def started_by_execnet() -> list[int]:
    """This process's children that execnet started as `python -c BOOTSTRAP`: the workers, or
    the launchers standing in for them. A child's pid is not reused before it is reaped."""
    from execnet.gateway_io import popen_bootstrapline

    parent, bootstrap = str(os.getpid()).encode(), popen_bootstrapline.encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # it has ended
            continue
        if stat.rsplit(b")", 1)[1].split()[1] == parent and bootstrap in command:
            found.append(int(entry))
    return found


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` with `--dist megatron`: one worker per GPU, or per CPU core (at most one per
    slot) in CPU mode, times `--megatron-gangs-per-device`; none, so that the tests run serially
    in this process, where the devices fit one gang at a time (one device and one gang on it, or
    every test known to need more than half of them): workers would only add their start-up and
    xdist's messages to the same work.

    Asked before pytest_configure, so the devices are read here, not from the plugin's state."""
    if not requested(config):
        return None
    try:
        devices = detect_devices(config.getoption("megatron_devices"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    per_device = gangs_per_device(config)
    workers = devices.count if devices.is_cuda else min(os.cpu_count() or 1, devices.count)
    world_sizes, known_from = known_world_sizes(config)
    if placement.gangs_at_once(devices.count, world_sizes, per_device) > 1:
        return workers * per_device
    config.stash[AUTO_SERIAL] = (
        f"-n auto: the {devices.count} device(s) {fit(devices.count, world_sizes)}, so the "
        f"tests run here, without xdist workers (world sizes: {known_from})"
    )
    return 0


def fit(device_count: int, world_sizes: set[int]) -> str:
    """What the devices fit of these world sizes, as the header says it; a size larger than the
    devices fits no gang (its tests are skipped: 'needs N devices, M available')."""
    fitting = [size for size in world_sizes if size <= device_count]
    if world_sizes and not fitting:
        sizes = ", ".join(map(str, sorted(world_sizes)))
        return f"fit no gang of {sizes} (those tests are skipped)"
    return f"fit one gang of {min(fitting, default=1)} at a time"


def known_world_sizes(config: pytest.Config) -> tuple[set[int], str]:
    """The world sizes this run's tests are known to have before collection: those
    --megatron-world-sizes selects, else those of the durations file's tests, else those the
    last run's tests had (the pytest cache); an unmarked test is 1 (it holds its worker's home
    device). None when nothing says. With the sizes: where they come from, for the header."""
    selected = selection.world_sizes(config)
    if selected:
        return selected, "--megatron-world-sizes"
    path = durations.file_path(config)
    if path is None:
        return durations.cached_world_sizes(config), "the last run's, in the pytest cache"
    try:
        timings = durations.read_file(path)
    except (OSError, ValueError):  # pytest_configure says what is wrong with it
        return set(), "none"
    return {timing.world_size or 1 for timing in timings.values()}, f"the durations file {path}"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: list) -> None:
    """Give worker j its index, a MASTER_PORT of its own and, on GPUs, its home device before
    it imports anything.

    Suites written for torchrun join a process group at import, in whatever process collects
    them (Megatron-LM's `Utils.initialize_model_parallel()` at module level, on MASTER_PORT or
    6000): torchrun gives each of its processes the port of its own run, and so must the workers
    here, or all but one of them fail to collect those modules. The environment goes into the
    spec string so that a replacement worker (xdist clones the spec of a crashed one) inherits
    the same index and devices.

    Under `--dist megatron` a worker is forked from the shared zygote (`forked_python`)."""
    import execnet

    devices = config.stash[CONTROLLER_RUNTIME].devices
    python = forked_python(config)
    ports: list[int] = []
    for index, spec in enumerate(specs):
        ports.append(worker_port(taken=ports))
        env = f"//env:{WORKER_VAR}={index}//env:MASTER_PORT={ports[-1]}"
        if devices.is_cuda:
            home = placement.home_device(devices, index)
            env += f"//env:CUDA_VISIBLE_DEVICES={devices.visible_devices((home,))}"
            if devices.count > 1 and on_gangs.mode(config) == "auto":
                env += f"//env:{RUN_DEVICE_COUNT_VAR}={devices.count}"
        if python is not None and spec.popen and not (spec.python or spec.via):
            env += f"//python={python}"
        replacement = execnet.XSpec(f"{spec}{env}")
        replacement.id = spec.id  # keep gw0, gw1...: PYTEST_XDIST_WORKER matches the index
        specs[index] = replacement


def forked_python(config: pytest.Config) -> str | None:
    """The `python` of a worker forked from the shared zygote: each worker then starts with
    torch and the packages the controller's conftest files import (the zygote followed them),
    not importing them all again, once per worker, on the way to its first test. None where
    the workers start as usual: not --dist megatron, or a measured run (a forked worker would
    inherit the zygote's coverage measurement)."""
    if not requested(config) or rank_coverage.driver_target() is not None:
        return None
    address = config.stash[CONTROLLER_RUNTIME].host_zygote()
    return f"{sys.executable} -I {LAUNCHER} {address}"


def worker_port(taken: list[int]) -> int:
    """A TCP port for a worker's MASTER_PORT that nothing listens on now, outside the kernel's
    ephemeral range and not in `taken`.

    The worker binds it only when it collects a module that joins a group at import, maybe a
    minute after this pick. An ephemeral port could be handed to any `bind(0)` or outgoing
    connection meanwhile (another worker's store, NCCL's bootstrap): on the H200 one of four
    workers failed to collect such a module with EADDRINUSE, and so got no work. torchrun's
    default port, 29500, lies outside that range too."""
    low, high = ephemeral_ports()
    outside = [*range(PORT_FLOOR, low), *range(high + 1, 65536)]
    for port in _draw.sample(outside, min(PORT_TRIES, len(outside))):
        if port not in taken and listenable(port):
            return port
    with socket.socket() as probe:  # no room outside the range: the kernel's pick
        probe.bind((LOCALHOST, 0))
        return probe.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    """The ports the kernel hands out by itself (Linux's default where it cannot be read)."""
    try:
        low, high = Path(EPHEMERAL_RANGE).read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def listenable(port: int) -> bool:
    """Whether a store could listen on `port` on every address now."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def placed_devices(config: pytest.Config) -> placement.DeviceSet:
    """The run's devices as the workers place gangs on them: knowing how many workers share
    them, so each worker's blocks nest (`placement.gang_slot`)."""
    devices = config.stash[CONTROLLER_RUNTIME].devices
    return placement.shared_by(devices, len(config.getoption("tx")))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    runtime = node.config.stash[CONTROLLER_RUNTIME]
    node.workerinput[INPUT_KEY] = {
        "worker": int(node.gateway.spec.env.get(WORKER_VAR, 0)),
        "devices": placement.to_dict(placed_devices(node.config)),
        "session_dir": runtime.session_dir,
        "lock_dir": runtime.lock_dir,
        # Shared by the workers; only for --dist megatron, where the suite surely has gangs.
        "zygote": runtime.host_zygote() if requested(node.config) else None,
    }


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """A worker crashed while its gang ran `crashitem`: xdist's headline names the cause; how
    the gang's ranks ended, which only the shared zygote saw, follows it."""
    if not isinstance(sched, MegatronScheduling) or not isinstance(report.longrepr, str):
        return
    world_size = sched.world_size_of(crashitem)
    if world_size is None:  # an unmarked test: it ran in the worker, on no gang
        return
    runtime = sched.config.stash[CONTROLLER_RUNTIME]
    ends = runtime.ranks_left_with(report.node.gateway.id, RANK_END_WAIT)
    if ends:
        report.longrepr = _worker_crash(report.longrepr, world_size, ends)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if not requested(config):
        return None
    runtime = config.stash[CONTROLLER_RUNTIME]
    return MegatronScheduling(
        config,
        placed_devices(config),
        worker_count=len(config.getoption("tx")),
        item_info=lambda: sidechannel.read_items(runtime.session_dir),
        durations=durations.load(config),
        session_dir=runtime.session_dir,
        log=log,
    )


def _worker_crash(headline: str, world_size: int, ends: list[RankEnd]) -> str:
    """xdist's report of a worker that crashed while its gang ran the test: its headline names
    what happened first (`worker 'gw0' crashed while running ...`); how the gang's ranks ended
    then follows it."""
    lines = [f"rank {e.rank} {describe_exit(e.code)}" for e in ends if e.world_size == world_size]
    if not lines:
        return headline
    return "\n".join([headline, f"its gang of {world_size} ended with it:", *lines])
