"""The pytest hooks through which a process that uses the plugin drives its Runtime: the run of
each test, the zygote's start, the timeouts and the summary (the serial driver, an xdist worker
or controller, a gang's rank or a torchrun rank).

plugin.py registers this module once the run is known to use the plugin: before the conftest
files load where its options, ini or the pytest cache say so, else when collection finds the
first test on a gang. Collection's own two steps (`parametrize`, `assign`) are called by
plugin.py's hooks, which see every test, so that their order among other plugins' hooks stays
the same wherever that moment falls.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Generator
from typing import Any

import pytest

from .. import parsed_sources
from ..ci import durations, path_options, selection
from ..coverage import rank_coverage
from ..protocol import TIMEOUT, WORLD_SIZE, on_gang_rank
from ..ranks.inprocess import PLUGIN_NAME as RANK_PLUGIN
from . import collection, dispatch
from .runtime import RUNTIME, Runtime, gangs_per_device
from .timeouts import default_timeout, timeout_of


def configure(config: pytest.Config) -> Runtime:
    """The process's Runtime, its settings checked and its role's plugin registered: a rank's
    (ours, or torchrun's) runs tests right here, a driver's sends them to gangs."""
    runtime = config.stash[RUNTIME] = Runtime(config)
    undo = parsed_sources.install()  # in every process that uses the plugin: driver, worker, rank
    if undo is not None:
        config.add_cleanup(undo)
    _check_settings(config, runtime)
    if runtime.inprocess is not None:
        config.pluginmanager.register(runtime.inprocess, RANK_PLUGIN)
    else:
        dispatcher = dispatch.GangDispatch(runtime, timeout_of)
        config.pluginmanager.register(dispatcher, "xdist-megatron-dispatch")
    # At exit CPython's last collections walk every object torch and megatron allocated: about
    # 2 s per process with megatron.core loaded. Frozen objects are skipped; the language does
    # not promise to finalise objects still alive at exit, and atexit handlers all still run.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    return runtime


def _check_settings(config: pytest.Config, runtime: Runtime) -> None:
    """A bad value is a usage error now, not a failure per test."""
    default_timeout(config)
    gangs_per_device(config)
    selection.check(config)
    durations.check(config)
    path_options.check(config)
    if config.getoption("megatron_devices") is not None and runtime.inprocess is None:
        runtime.devices  # noqa: B018 - likewise: a bad spec fails the run here, in every mode


def parametrize(metafunc: pytest.Metafunc) -> None:
    collection.parametrize(metafunc, metafunc.config.stash[RUNTIME])


def assign(config: pytest.Config, items: list[pytest.Item]) -> None:
    collection.assign(config, items, config.stash[RUNTIME])


def pytest_unconfigure(config: pytest.Config) -> None:
    runtime = config.stash.get(RUNTIME, None)
    if runtime is not None:
        runtime.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[RUNTIME].close()


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
