"""Coverage of the code that runs in the zygote and on the ranks, added to the driver's own.

The driver measures itself (pytest-cov, or `coverage run`); its zygote and ranks are processes
forked outside coverage's knowledge that end with `os._exit`, so coverage never saves them. When
the driver measures, each of them measures itself with the driver's configuration and, after each
unit of work (a preload, a job), publishes its whole data file into the driver's store folder by
an atomic rename: a rank killed during a job loses that job's lines, and a half-written file is
never published. The driver combines the store into its own measurement before pytest-cov reports
(or coverage saves at exit), so one report shows every process.

The zygote measures its preloads (a module's top-level lines run once, there, before any rank
exists); a rank stops the measurement it inherits from the zygote and starts its own.
Nothing here imports coverage unless the driver measures: it is no dependency of the plugin.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import io
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Generator
from typing import Any

import pytest

from ..protocol import CoverageTarget

PUBLISHED = ".data"  # a whole data file in the store, ready to combine
CONFIG_DATA_PREFIX = ":data:"  # coverage's marker for a serialized configuration (>= 7.10)
# The driver warns about these once; every rank saying them again is noise.
QUIET_WARNINGS = (
    "module-not-measured",
    "module-not-imported",
    "no-data-collected",
    "no-sysmon",
    "no-ctracer",
)
# coverage's `patch = subprocess` starts coverage in every new Python process that has these:
# the zygote is measured here instead, into the driver's store.
PROCESS_START_VARS = ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG")

_target: CoverageTarget | None = None  # in a measured driver: where its processes publish
_recorder: Recorder | None = None  # in the zygote or a rank: its own measurement


def driver_target() -> CoverageTarget | None:
    """Where this driver's zygote and ranks send their coverage; None when it is not measured."""
    global _target
    if _target is None:
        cov = current()
        if cov is None:
            return None
        if not hasattr(cov.config, "serialize"):
            warnings.warn("xdist-megatron measures ranks with coverage >= 7.10 only", stacklevel=2)
            return None
        store = tempfile.mkdtemp(prefix="xdist-megatron-coverage-")
        _target = CoverageTarget(cov.config.serialize(), store)
        atexit.register(_last_combine)  # runs before coverage's own, which saves at exit
    return _target


def targeted() -> bool:
    """Whether this driver sent its zygote or ranks a target (their data is to combine)."""
    return _target is not None


def zygote_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of a zygote this driver starts: measured by us, not by coverage's hook."""
    if driver_target() is None:
        return env
    return {name: value for name, value in env.items() if name not in PROCESS_START_VARS}


def close_and_combine(close: Callable[[], None]) -> None:
    """At the end of a measured test loop, inside pytest-cov's wrapper (before it combines and
    reports): `close` the zygote and the ranks, then add their coverage to this process's."""
    if targeted():
        close()
        combine_into_driver()


def combine_into_driver() -> None:
    """Add what the zygote and the ranks published so far to the driver's measurement (the
    files are consumed)."""
    cov = current()
    if _target is not None and cov is not None:
        combine(cov, _target.store)


def _last_combine() -> None:
    global _target
    combine_into_driver()
    if _target is not None:
        shutil.rmtree(_target.store, ignore_errors=True)
        _target = None


def current() -> Any:
    """The running coverage.Coverage of this process, without importing coverage."""
    module = sys.modules.get("coverage")
    return None if module is None else module.Coverage.current()


class Recorder:
    """This process's own measurement, published whole into a store folder."""

    def __init__(self, cov: Any, store: str, name: str) -> None:
        """`cov`: a coverage.Coverage not started yet, configured as the driver's."""
        base = os.path.join(store, f"{name}-{os.getpid()}")
        self._live = base + ".live"  # written in place by coverage (a kill may corrupt it)
        self._published = base + PUBLISHED
        self.cov = cov
        cov.set_option("run:data_file", self._live)
        cov.set_option("run:parallel", False)
        cov.set_option("run:sigterm", False)  # our ranks' signals stay ours
        cov.set_option("run:patch", [])  # forks and exits here are ours to handle
        quiet = list(cov.get_option("run:disable_warnings") or []) + list(QUIET_WARNINGS)
        cov.set_option("run:disable_warnings", quiet)
        # After each save coverage walks the source folders to list the files never executed
        # (35 ms with megatron.core, at every test of every rank): the driver lists them once.
        if hasattr(cov, "_post_save_work"):
            cov._post_save_work = lambda: None
        cov.start()

    def publish(self) -> None:
        self.cov.save()
        if not os.path.exists(self._live):  # nothing measured yet
            return
        partial = self._live + ".partial"
        shutil.copyfile(self._live, partial)
        os.replace(partial, self._published)

    def stop(self) -> None:
        self.cov.stop()


def measure(target: CoverageTarget | None, name: str) -> None:
    """Measure this process (the zygote, or a rank named `name`) for the driver: first stop
    the measurement inherited from the zygote (its lines are the zygote's to publish)."""
    global _recorder
    if _recorder is not None:
        _recorder.stop()
        _recorder = None
    if target is not None:
        from coverage import Coverage

        measure_with(Coverage(config_file=CONFIG_DATA_PREFIX + target.config), target.store, name)


def measure_with(cov: Any, store: str, name: str) -> None:
    """Measure this process with `cov` (configured, not started), publishing into `store`."""
    global _recorder
    _recorder = Recorder(cov, store, name)


def combine(cov: Any, store: str) -> None:
    """Add the data files published in `store` to `cov`'s measurement (they are consumed)."""
    published = sorted(glob.glob(os.path.join(store, "*" + PUBLISHED)))
    if published:
        with contextlib.redirect_stderr(io.StringIO()):  # `coverage run` counts the files
            cov.combine(published)


def measured() -> bool:
    """Whether this process measures itself for another (a driver, or torchrun's rank 0)."""
    return _recorder is not None


def publish() -> None:
    """Publish what this process measured so far (nothing when it is not measured)."""
    if _recorder is not None:
        _recorder.publish()


def follow_tests(config: pytest.Config) -> None:
    """On a measured rank: the rank's session labels lines with the test's context and pauses
    for `no_cover` tests, as pytest-cov does in the driver."""
    if _recorder is not None:
        by_test = config.getoption("cov_context", None) == "test"
        config.pluginmanager.register(TestFollower(_recorder, by_test), "xdist-megatron-coverage")


class TestFollower:
    """pytest-cov's per-test behaviour, for a rank's own measurement."""

    __test__ = False  # not a test class

    def __init__(self, recorder: Recorder, by_test: bool) -> None:
        self._cov = recorder.cov
        self._by_test = by_test

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self._label(item, "setup")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        self._label(item, "run")
        paused = _wants_no_cover(item)
        if paused:
            self._cov.stop()
        try:
            return (yield)
        finally:
            if paused:
                self._cov.start()

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self._label(item, "teardown")

    def _label(self, item: pytest.Item, when: str) -> None:
        if self._by_test:
            self._cov.switch_context(f"{item.nodeid}|{when}")  # pytest-cov's label


def _wants_no_cover(item: pytest.Item) -> bool:
    return item.get_closest_marker("no_cover") is not None or "no_cover" in getattr(
        item, "fixturenames", ()
    )
