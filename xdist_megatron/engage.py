"""What a run that uses the plugin sets up, once it is known to, in each role (`roles.py`):
its settings checked, and the runtime of the process's role with the hook modules that drive it:
the controller's (`controller/runtime.py`), a driver's (`driver/runtime_hooks.py`, with the
plugins that stamp and report its tests) or a rank's (`ranks/inprocess.py`). plugin.py calls it
at `pytest_configure` where that is known early, else when collection finds the first test on a
gang."""

from __future__ import annotations

import atexit
import gc
from typing import TYPE_CHECKING

import pytest

from . import parsed_sources
from .ci import durations, path_options, selection
from .devices import gangs_per_device
from .driver.timeouts import default_timeout
from .report import run_report
from .roles import Role, role_of

if TYPE_CHECKING:
    from .controller.runtime import ControllerRuntime
    from .driver.runtime import Runtime
    from .ranks.inprocess import InProcessRank

CONTROLLER_PLUGIN = "xdist_megatron.controller.hooks"  # its -n auto is asked before configure
FIXTURES_PLUGIN = "xdist_megatron.driver.fixtures"
DRIVER_PLUGIN = "xdist_megatron.driver.runtime_hooks"
REPORT = "xdist-megatron-run-report"
# The role's runtime, once the run is known to use the plugin
RUNTIME = pytest.StashKey["ControllerRuntime | Runtime | InProcessRank"]()


def engage(
    config: pytest.Config, follow: bool = False
) -> ControllerRuntime | Runtime | InProcessRank:
    """From the moment the run is known to use the plugin: its settings checked, the imports
    followed for the zygote where that is known only at collection (`follow`), and the runtime
    of the process's role with its hook modules: the controller's; a driver's, with the plugins
    that stamp and report its tests; a rank's, which runs them right here."""
    _check_settings(config)
    undo = parsed_sources.install()
    if undo is not None:
        config.add_cleanup(undo)
    # At exit CPython's last collections walk every object torch and megatron allocated: about
    # 2 s per process with megatron.core loaded. Frozen objects are skipped; the language does
    # not promise to finalise objects still alive at exit, and atexit handlers all still run.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    role = role_of(config)
    manager = config.pluginmanager
    if role is Role.CONTROLLER:
        manager.import_plugin(CONTROLLER_PLUGIN)  # once; not where `-p no:NAME` blocks it
        from .controller import runtime as controller_runtime

        runtime = config.stash[RUNTIME] = controller_runtime.configure(config)
        manager.register(run_report.RunReport(config, lambda: runtime.devices.ids), REPORT)
        return runtime
    manager.import_plugin(FIXTURES_PLUGIN)
    if role.is_rank:
        from .ranks import inprocess, rank

        finish_line = rank.finish_line if role is Role.GANG_RANK else None
        config.stash[RUNTIME] = inprocess.configure(config, finish_line)
        return config.stash[RUNTIME]
    manager.import_plugin(DRIVER_PLUGIN)
    from .driver import import_follower, runtime_hooks  # after: pytest rewrites its plugins
    from .driver.run_facts import RunFacts

    if follow:
        import_follower.start(config)
    driver = config.stash[RUNTIME] = runtime_hooks.configure(config)
    manager.register(RunFacts(driver), "xdist-megatron-run-facts")
    if role is Role.SERIAL:  # the controller reports a worker's tests
        manager.register(run_report.RunReport(config, lambda: driver.devices.ids), REPORT)
    return driver


def _check_settings(config: pytest.Config) -> None:
    """A bad value is a usage error now, not a failure per test."""
    default_timeout(config)
    gangs_per_device(config)
    selection.check(config)
    durations.check(config)
    path_options.check(config)
