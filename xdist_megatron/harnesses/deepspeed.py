"""DeepSpeed's `DistributedTest` and `DistributedFixture` (its `tests/unit/common.py`) on gangs.

Under plain pytest, DeepSpeed's conftest calls the test's class in place of its body: that
resolves the test's fixtures in the parent, reads its world size (the method's `world_size`
mark, else a `world_size` argument, else the class's attribute: an int or a list) and, for each
size, makes a file store, checks the accelerator's device count, starts a forkserver pool of
that many processes, runs `_dist_run` on each (environment, device, `deepspeed.init_distributed`,
the test) and sleeps 0.5 s. A hang past `exec_timeout` calls `pytest.exit`, ending the session.
A `DistributedFixture` is launched the same way at its setup and hands its results on through
files in `class_tmpdir`.

Here the harness's base class is patched where it defines the launch: each size keeps DeepSpeed's
own checks (`_launch_procs`), then runs `_dist_run` on the ranks of a gang of that size
(`deepspeed_child`) in place of the pool; the ranks' skip message or failure is the test's, and a
hang fails the test alone (its gang is replaced). A world-size list makes one test per size (ids
ws1, ws2...), as the plugin's marker does, so that sizes are scheduled apart. A size over the
run's devices, or a test that does not pickle, launches as before.

The `world_size` mark on these tests is the harness's, never the plugin's (also with
--megatron-harnesses off). Nothing of DeepSpeed is imported here (DESIGN, invariant 6).
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from .. import markers
from ..driver.timeouts import timeout_of
from ..protocol import GANGS_AT_CALL, HARNESS, WORLD_SIZE
from .on_gangs import GangCaller, HarnessError, free_port, mode

if TYPE_CHECKING:
    from ..driver.runtime import Runtime

NAME = "DeepSpeed DistributedTest"
BASE = "DistributedExec"
LAUNCHES = ("_launch_daemonic_procs", "_launch_non_daemonic_procs")  # what the pool replaces
USED = ("_launch_with_file_store", "_launch_procs", "_dist_run", *LAUNCHES)
SIZE_MARK = "world_size"
PATCHED = "_xdist_megatron_patched"


def _base(cls: Any) -> type | None:
    return next((base for base in getattr(cls, "__mro__", ()) if base.__name__ == BASE), None)


def owns(cls: Any) -> bool:
    """Whether `cls` is a test class of the harness (its `world_size` mark is the harness's)."""
    return (
        isinstance(cls, type) and getattr(cls, "is_dist_test", False) is True and bool(_base(cls))
    )


def recognised(item: pytest.Item) -> bool:
    return owns(getattr(item, "cls", None)) and mode(item.config) == "auto"


def declared_sizes(function: Any, cls: type, arguments: dict[str, Any]) -> list[int] | None:
    """The sizes the harness launches a test at, read as its `__call__` reads them (None: not
    known before the test's fixtures are)."""
    for mark in getattr(function, "pytestmark", []):
        if mark.name == SIZE_MARK and mark.args:
            value = mark.args[0]
            break
    else:
        value = arguments.get(SIZE_MARK, getattr(cls, SIZE_MARK, None))
    sizes = [value] if isinstance(value, int) else value
    if not isinstance(sizes, list | tuple) or not all(type(s) is int for s in sizes):
        return None
    return list(dict.fromkeys(sizes)) or None


def parametrize(metafunc: pytest.Metafunc) -> None:
    """One test per size of a world-size list, as the plugin's marker makes them."""
    if mode(metafunc.config) != "auto" or SIZE_MARK in metafunc.fixturenames:
        return
    sizes = declared_sizes(metafunc.function, metafunc.cls, {})
    if sizes is not None and len(sizes) > 1:
        markers.one_item_per_size(metafunc, sizes)


def _sizes_of(item: pytest.Item) -> list[int] | None:
    callspec = getattr(item, "callspec", None)
    arguments = callspec.params if callspec is not None else {}
    if markers.PARAM in arguments:
        return [arguments[markers.PARAM]]
    return declared_sizes(getattr(item, "function", None), item.cls, arguments)


def assign(config: pytest.Config, items: list[pytest.Item], runtime: Runtime) -> None:
    """Mark the harness's tests as its own; where they run on gangs, give each the largest size
    it launches at and install the adapter once in this driver."""
    owned = [item for item in items if owns(getattr(item, "cls", None))]
    for item in owned:
        item.stash[HARNESS] = NAME
    if not owned or mode(config) != "auto":
        return
    adapter = _installed(config, runtime, {_base(item.cls) for item in owned})
    for item in owned:
        sizes = _sizes_of(item)
        if _base(item.cls) in adapter.left_alone:
            continue
        if sizes is not None and max(sizes) <= runtime.devices.count:
            item.stash[WORLD_SIZE] = max(sizes)
            adapter.on_gangs += 1
        else:
            adapter.unfit += 1


def _installed(config: pytest.Config, runtime: Runtime, bases: set[Any]) -> DeepSpeedHarness:
    global _active
    adapter = config.stash.get(ADAPTER, None)
    if adapter is None:
        adapter = config.stash[ADAPTER] = _active = DeepSpeedHarness(runtime)
        config.stash[GANGS_AT_CALL] = True  # a test's fixtures may launch at sizes of their own
        config.pluginmanager.register(adapter, "xdist-megatron-deepspeed-harness")
        config.add_cleanup(_deactivate)
    for base in bases:
        missing = [name for name in USED if name not in vars(base)]
        if missing:
            adapter.left_alone.add(base)
            adapter.notes.append(f"{BASE} lacks {', '.join(missing)}: its tests spawn")
        else:
            _patch(base)
    return adapter


def _deactivate() -> None:
    """The run ended: a test launched after it (pytester in-process) spawns as without us."""
    global _active
    _active = None


class DeepSpeedHarness(GangCaller):
    """The driver's adapter: launches the test that runs now on gangs, and counts them."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime)
        self.on_gangs = 0  # tests collected to run on gangs
        self.unfit = 0  # collected, but a size is over the run's devices (or not known)
        self.launches = 0
        self.spawned: Counter[str] = Counter()  # launches that spawned anyway, and why
        self.notes: list[str] = []
        self.left_alone: set[Any] = set()
        self.launching: Any = None  # the test or fixture whose launch goes to a gang now

    def follows(self, item: pytest.Item) -> bool:
        return item.stash.get(HARNESS, None) == NAME

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        text = f"{NAME}: {self.on_gangs} tests on gangs"
        if self.unfit:
            text += f", {self.unfit} with a size over the devices or known only at their call"
        return [f"xdist-megatron: {line}" for line in (text, *self.notes)]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        text = f"xdist-megatron: {NAME}: {self.launches} launches on gangs"
        if self.spawned:
            text += "; spawned: " + ", ".join(f"{n} {why}" for why, n in self.spawned.items())
        if self.launches or self.spawned:
            terminalreporter.line(text)

    def takes(self, request: Any) -> bool:
        """Whether a launch is the running test's own (or its fixture's)."""
        return self.item is not None and getattr(request, "node", None) is self.item

    def launch(self, test: Any, request: Any, world_size: Any, launch_as_before: Callable) -> None:
        """The harness's launch at each size (the item's own, where a list was split)."""
        __tracebackhide__ = True
        sizes = [world_size] if isinstance(world_size, int) else list(world_size)
        callspec = getattr(self.item, "callspec", None)
        split = callspec.params.get(markers.PARAM) if callspec is not None else None
        if getattr(test, "is_dist_test", False) and split in sizes:  # not its fixtures' sizes
            sizes = [split]
        tmpdir = request.getfixturevalue("tmpdir")
        for size in sizes:
            why_not = self.unfit_launch(size, test)
            if why_not:
                self.spawned[why_not] += 1
                launch_as_before(test, request, size)
                continue
            with tempfile.NamedTemporaryFile(
                delete=False, dir=str(tmpdir), suffix="_filestore"
            ) as f:
                init_method = f"file://{f.name}"
            self.launching = test
            try:
                test._launch_procs(size, init_method)  # the harness's checks, then `run`
            finally:
                self.launching = None

    def unfit_launch(self, size: int, test: Any) -> str:
        """Why a launch of `size` spawns as without the plugin (empty: it runs on a gang)."""
        if not 0 < size <= self.runtime.devices.count:
            return "size over the devices"
        try:
            pickle.dumps(test)
        except Exception:
            return "tests that do not pickle"
        return ""

    def run(self, test: Any, size: int, init_method: str) -> None:
        """`_dist_run` on every rank of a gang of `size`, then the cleanup; the ranks' failure
        or skip is the test's."""
        __tracebackhide__ = True
        from .deepspeed_child import run_rank  # what a rank imports: not in runs without it

        self.launches += 1
        timeout = min(float(test.exec_timeout), timeout_of(self.item))
        arguments = (test, size, init_method, free_port(), dict(os.environ))
        results = self.call_and_clean(size, run_rank, arguments, timeout, "the test")
        skips = {result.value for result in results if result.value}
        if len(skips) > 1:
            raise HarnessError(f"the ranks skipped for different reasons: {sorted(skips)}")
        if skips:
            pytest.skip(skips.pop())


ADAPTER = pytest.StashKey[DeepSpeedHarness]()
_active: DeepSpeedHarness | None = None  # this process's run's adapter, where it has one


def _patch(base: Any) -> None:
    """Route the harness's launches through the adapter (once per process)."""
    if vars(base).get(PATCHED):
        return
    with_file_store = base._launch_with_file_store

    def _launch_with_file_store(self: Any, request: Any, world_size: Any) -> None:
        adapter = _active
        if adapter is None or not adapter.takes(request):
            return with_file_store(self, request, world_size)
        return adapter.launch(self, request, world_size, with_file_store)

    base._launch_with_file_store = _launch_with_file_store
    for name in LAUNCHES:
        setattr(base, name, _on_gang_or(getattr(base, name)))
    setattr(base, PATCHED, True)


def _on_gang_or(launch_as_before: Callable) -> Callable:
    def launch(self: Any, num_procs: int, init_method: str, *args: Any) -> None:
        adapter = _active
        if adapter is None or adapter.launching is not self:
            return launch_as_before(self, num_procs, init_method, *args)
        return adapter.run(self, num_procs, init_method)

    return launch
