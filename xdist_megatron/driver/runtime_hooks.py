"""The pytest hooks through which a driver (the serial pytest process or an xdist worker) drives
its Runtime: the run of each test, the zygote's start, the timeouts and the summary.

plugin.py registers this module once the run is known to use the plugin, in a driver: at
`pytest_configure` where its options, ini or the pytest cache say so, else when collection
finds the first test on a gang.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from ..coverage import rank_coverage
from ..protocol import TIMEOUT, WORLD_SIZE
from . import dispatch
from .runtime import RUNTIME, Runtime
from .timeouts import timeout_of


def configure(config: pytest.Config) -> Runtime:
    """The driver's Runtime, its devices checked (a bad spec fails the run here, not per test),
    and the plugin that sends its tests to gangs."""
    runtime = config.stash[RUNTIME] = Runtime(config)
    if config.getoption("megatron_devices") is not None:
        runtime.devices  # noqa: B018
    dispatcher = dispatch.GangDispatch(runtime, timeout_of)
    config.pluginmanager.register(dispatcher, "xdist-megatron-dispatch")
    return runtime


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
        rank_coverage.close_and_combine(session.config.stash[RUNTIME].close)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator:
    if WORLD_SIZE in item.stash:
        return (yield)
    with item.config.stash[RUNTIME].home_device_held():
        return (yield)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout: for tests on gangs the driver owns the timer (it dumps every rank's
    stack)."""
    if not item.config.stash[RUNTIME].runs_on_ranks(item):
        return None
    item.stash[TIMEOUT] = float(settings.timeout)
    return True


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    return True if item.config.stash[RUNTIME].runs_on_ranks(item) else None
