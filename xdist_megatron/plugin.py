"""pytest hooks of xdist-megatron: options, collection, the run of each test, the summary.

Each hook hands its work to the layer that owns it (README, "Architecture"): `driver/` for
what the pytest process does, `xdist/` for the controller, `report/` and `ci/` for what they
add. The rank fixtures, the xdist hooks, the Ctrl-C latch and the torchrun coverage are hook
modules of their own, registered here.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Generator
from typing import Any

import pytest

from . import layouts, markers, parsed_sources
from .ci import durations, path_options, selection
from .coverage import rank_coverage
from .driver import bytecode, collection, dispatch, import_follower
from .driver.pool import SESSION_SCOPE
from .driver.runtime import RUNTIME, Runtime, gangs_per_device
from .driver.timeouts import DEFAULT_TIMEOUT, default_timeout, timeout_of
from .protocol import TIMEOUT, WORLD_SIZE, on_gang_rank
from .ranks.inprocess import PLUGIN_NAME as RANK_PLUGIN
from .report import run_report
from .report.run_facts import RunFacts
from .xdist import hooks as xdist_hooks

pytest_plugins = [
    "xdist_megatron.coverage.torchrun_coverage",  # its hooks must precede pytest-cov's
    "xdist_megatron.xdist.hooks",
    "xdist_megatron.driver.fixtures",
    "xdist_megatron.driver.interrupts",  # Ctrl-C is never lost
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(
        "megatron", "xdist-megatron: distributed tests on persistent rank gangs"
    )
    group.addoption(
        "--megatron-timeout",
        type=float,
        default=None,
        help="seconds a test may run on a gang before its ranks' stacks are dumped and the gang "
        "is killed (default: ini megatron_timeout, 300).",
    )
    group.addoption(
        "--megatron-world-size",
        default=None,
        help="world size of every unmarked test, so that a suite written for `torchrun "
        "--nproc-per-node N -m pytest` runs unchanged (default: ini megatron_world_size; unset: "
        "unmarked tests run in the pytest process).",
    )
    group.addoption(
        "--megatron-devices",
        default=None,
        help="devices for gangs: '0,1,2,3' (GPU indices) or 'cpu:N' (N CPU slots); default: every "
        "visible GPU, else CPU mode with max(8, cores) slots.",
    )
    group.addoption(
        "--megatron-backend",
        default=None,
        help="torch.distributed backend of the gangs (default 'cpu:gloo,cuda:nccl' on GPUs, "
        "'gloo' on CPU).",
    )
    group.addoption(
        "--megatron-lock-dir",
        default=None,
        help="folder of the device locks; point several pytest sessions on one host at the same "
        "folder to let them share its GPUs safely (default: one folder per session).",
    )
    group.addoption(
        "--megatron-gangs-per-device",
        type=int,
        default=None,
        help="at most K gangs hold a device at once, across workers and sessions sharing the "
        "lock folder; -n auto starts K workers per device (default: ini "
        "megatron_gangs_per_device, 1).",
    )
    selection.add_options(group, parser)
    durations.add_options(group, parser)
    run_report.add_options(group)
    xdist_hooks.add_dist_choice(parser)
    parser.addini("megatron_timeout", "default of --megatron-timeout", default=str(DEFAULT_TIMEOUT))
    parser.addini("megatron_world_size", "default of --megatron-world-size", default="")
    parser.addini(
        "megatron_gangs_per_device", "default of --megatron-gangs-per-device", default="1"
    )
    parser.addini(
        "megatron_preload",
        "modules the zygote imports once for every rank, at its start (default: torch, "
        "torch.distributed and the library packages the driver imports, as it imports them)",
        type="linelist",
    )
    parser.addini(
        "megatron_gang_scope",
        "session: one gang per world size for the session, reset at module boundaries; "
        "module: a fresh gang for every module",
        default=SESSION_SCOPE,
    )


def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Start the zygote's imports beside the driver's own, before the conftest files import the
    suite's packages (see import_follower); after pytest-cov started measuring (its hook is
    tryfirst), so that a zygote started at once measures its preloads too; with bytecode shared
    first where it is off, so that the zygote compiles nothing the driver has compiled."""
    bytecode.share(early_config)
    follower = import_follower.follow_imports(early_config)
    if follower is not None:
        early_config.stash[import_follower.FOLLOWER] = follower


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", markers.MARKER_HELP)
    config.addinivalue_line("markers", markers.EXCLUSIVE_HELP)
    config.addinivalue_line("markers", layouts.MARKER_HELP)
    config.addinivalue_line(
        "markers", "timeout(seconds): per-test timeout, honoured on gangs as well"
    )
    runtime = config.stash[RUNTIME] = Runtime(config)
    undo = parsed_sources.install()  # in every process: driver, xdist worker, rank
    if undo is not None:
        config.add_cleanup(undo)
    default_timeout(config)  # a bad value is a usage error now, not a failure per test
    gangs_per_device(config)
    selection.check(config)
    durations.check(config)
    path_options.check(config)
    if config.getoption("megatron_devices") is not None and runtime.inprocess is None:
        runtime.devices  # noqa: B018 - likewise: a bad spec fails the run here, in every mode
    if runtime.inprocess is not None:
        config.pluginmanager.register(runtime.inprocess, RANK_PLUGIN)
    else:
        _register_driver_plugins(config, runtime)
    # At exit CPython's last collections walk every object torch and megatron allocated: about
    # 2 s per process with megatron.core loaded. Frozen objects are skipped; the language does
    # not promise to finalise objects still alive at exit, and atexit handlers all still run.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    # The controller sees every report, workers need not; a gang's rank reports to its driver.
    if not hasattr(config, "workerinput") and not on_gang_rank():
        recorder = durations.DurationRecorder(config)
        config.pluginmanager.register(recorder, "xdist-megatron-durations")


def _register_driver_plugins(config: pytest.Config, runtime: Runtime) -> None:
    """The driver's own plugins; the run report only where every report arrives (the serial
    driver or the xdist controller)."""
    manager = config.pluginmanager
    manager.register(dispatch.GangDispatch(runtime, timeout_of), "xdist-megatron-dispatch")
    manager.register(RunFacts(runtime), "xdist-megatron-run-facts")
    if not hasattr(config, "workerinput"):
        report = run_report.RunReport(config, lambda: runtime.devices.ids)
        manager.register(report, "xdist-megatron-run-report")


def pytest_unconfigure(config: pytest.Config) -> None:
    runtime = config.stash.get(RUNTIME, None)
    if runtime is not None:
        runtime.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[RUNTIME].close()


def pytest_report_header(config: pytest.Config) -> str | None:
    if xdist_hooks.AUTO_SERIAL in config.stash:
        return f"xdist-megatron: {config.stash[xdist_hooks.AUTO_SERIAL]}"
    if xdist_hooks.requested(config) and not config.getoption("tx", None):
        return "xdist-megatron: --dist megatron without -n: marked tests run serially on gangs here"
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    collection.parametrize(metafunc, metafunc.config.stash[RUNTIME])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    collection.assign(config, items, config.stash[RUNTIME])


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[RUNTIME].start_zygote_early()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[RUNTIME].collection_done(session.items)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtestloop(session: pytest.Session) -> Generator:
    """A measured driver ends its gangs and zygote with the test loop and adds their coverage
    to its own, inside pytest-cov's wrapper: before it combines and reports."""
    try:
        return (yield)
    finally:
        if rank_coverage.targeted():
            session.config.stash[RUNTIME].close()
            rank_coverage.combine_into_driver()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator:
    if WORLD_SIZE in item.stash:
        return (yield)
    with item.config.stash[RUNTIME].home_device_held():
        return (yield)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout: for tests on gangs the driver owns the timer (it dumps every rank's
    stack); on a gang's rank, no timer (its driver's covers every rank)."""
    if on_gang_rank():
        return True
    if not item.config.stash[RUNTIME].runs_on_ranks(item):
        return None
    item.stash[TIMEOUT] = float(settings.timeout)
    return True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    runtime = item.config.stash[RUNTIME]
    return True if on_gang_rank() or runtime.runs_on_ranks(item) else None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    runtime = terminalreporter.config.stash.get(RUNTIME, None)
    notes = runtime.notes if runtime is not None else []
    if notes:
        terminalreporter.section("xdist-megatron")
        for note in notes:
            terminalreporter.line(note)
