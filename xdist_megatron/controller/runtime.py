"""The xdist controller's plugin state: the run's devices (to place its workers), the session
folder and lock folder its workers share, and the zygote they all fork from. Built once the run
is known to use the plugin (plugin.py); the controller runs no test and holds no gang."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Generator
from typing import TYPE_CHECKING

import pytest

from ..coverage import rank_coverage
from ..devices import run_devices
from ..driver import import_follower, preload
from ..placement import DeviceSet
from ..protocol import CLOSE_NOW, RankEnd

if TYPE_CHECKING:
    from ..driver.zygote_client import ZygoteClient


def configure(config: pytest.Config) -> ControllerRuntime:
    """The controller's runtime, registered as a plugin: it ends with the session."""
    runtime = config.stash[CONTROLLER_RUNTIME] = ControllerRuntime(config)
    config.pluginmanager.register(runtime, "xdist-megatron-controller")
    return runtime


class ControllerRuntime:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        if config.getoption("megatron_devices") is not None:
            self.devices  # noqa: B018 - a bad spec fails the run here, not at the workers' start
        self.session_dir = import_follower.followed_session_dir(config) or tempfile.mkdtemp(
            prefix="xdist-megatron-session-"
        )
        chosen = config.getoption("megatron_lock_dir")
        self.lock_dir = os.path.abspath(chosen or os.path.join(self.session_dir, "locks"))
        self._zygote: ZygoteClient | None = None
        self._notes: list[str] = []  # the follower's
        config.stash[CLOSE_NOW] = functools.partial(self.close, at_once=True)

    @functools.cached_property
    def devices(self) -> DeviceSet:
        """The run's devices, detected when first asked (the detection imports torch, which a
        Ctrl-C during the conftest files' imports may have left half imported)."""
        return run_devices(self.config)

    def host_zygote(self) -> str:
        """The address of the zygote every worker shares: the one started while the controller
        imported the suite's conftest files, else one started now with the preloads known
        (each worker adds the ones it detects)."""
        if self._zygote is None:
            self._zygote = import_follower.early_zygote(
                self.config, self.devices.is_cuda, self._notes
            )
        if self._zygote is None:
            from ..driver import zygote_client

            self._zygote = zygote_client.spawn(
                preload.known_early(self.config) or list(preload.ALWAYS_PRELOAD),
                zygote_client.host_zygote_log(self.session_dir, self.config.getoption("capture")),
                zygote_client.shared_address(),
                self.devices.is_cuda,
            )
        return self._zygote.address

    def ranks_left_with(self, worker: str, timeout: float) -> list[RankEnd] | None:
        """How the shared zygote ended the ranks of a crashed worker."""
        if self._zygote is None:
            return None
        return self._zygote.ranks_left_with(worker, timeout)

    @property
    def notes(self) -> list[str]:
        """What the terminal summary says."""
        return [*self._notes, *preload.withheld_notes(self.config)]

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtestloop(self) -> Generator[None, object, object]:
        """A measured controller ends the shared zygote with the test loop and adds its
        coverage to its own, before pytest-cov reports."""
        try:
            return (yield)
        finally:
            rank_coverage.close_and_combine(self.close)

    def pytest_sessionfinish(self) -> None:
        self.close()

    def pytest_unconfigure(self) -> None:
        self.close()

    def close(self, at_once: bool = False) -> None:
        """End the shared zygote and remove the session folder; `at_once` (Ctrl-C): kill it."""
        early = import_follower.finish_following(self.config, self._notes)
        if early is not None:
            early.close(at_once)
        if self._zygote is not None:
            self._zygote.close(at_once)
            self._zygote = None
        shutil.rmtree(self.session_dir, ignore_errors=True)


CONTROLLER_RUNTIME = pytest.StashKey[ControllerRuntime]()
