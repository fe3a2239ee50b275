"""PyTorch's `MultiProcessTestCase` family on gangs: the parent's side in the driver, the
children's on the ranks.

Under plain pytest the test case's `setUp` spawns `world_size` fresh interpreters
(`_start_processes`), the test method's wrapper waits for them (`_join_processes`) and
`_check_return_codes` turns their exit codes into the verdict: code 10 a failure with the
tracebacks they sent, rank 0's code from `TEST_SKIPS` a skip, anything but 0 (or what
`special_return_code_checks` expects) a failure. Here the harness's own classes are patched
where they define those two methods, so that subclasses and names imported earlier see it:
`_start_processes` only notes that children were asked for, and `_join_processes` runs what each
child would have run (`pytorch_child.run_child`) on a gang of the test's world size, then hands
the exit codes and tracebacks to the harness's own `_check_return_codes`. setUp, tearDown,
fixtures and the verdict stay in the driver, once. A test whose exit code is itself checked
(`skip_return_code_checks`, `special_return_code_checks`) spawns as before.

Nothing of `torch.testing._internal` is imported here: the harness is recognised only where the
suite itself imported it (DESIGN, invariant 6).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from ..protocol import HARNESS, PASSED, WHOLE_CLASS, WORLD_SIZE
from . import pytorch_continuous as continuous
from .device_view import run_devices_counted
from .on_gangs import GangCaller, HarnessError, mode

if TYPE_CHECKING:
    from ..driver.runtime import Runtime

NAME = "PyTorch MultiProcessTestCase"
HARNESS_MODULE = "torch.testing._internal.common_distributed"
PER_TEST, CONTINUOUS = "MultiProcessTestCase", "MultiProcContinuousTest"
USED = {  # what the adapter calls or replaces, per base class
    PER_TEST: ("_start_processes", "_join_processes", "_check_return_codes", "_run"),
    CONTINUOUS: ("_spawn_processes", "_get_world_size", "_init_pg", "_run_test_given_id"),
}
PENDING = "_xdist_megatron_pending_spawn"  # on a test case: the spawn its setUp asked for


def harness_base(name: str) -> type | None:
    """One of the harness's base classes, where the suite imported the harness."""
    base = getattr(sys.modules.get(HARNESS_MODULE), name, None)
    return base if isinstance(base, type) else None


def family(item: pytest.Item) -> str | None:
    """Which base a unittest item's test case derives from (PER_TEST or CONTINUOUS), if any."""
    cls = getattr(item, "cls", None)
    if not isinstance(cls, type) or type(item).__name__ != "TestCaseFunction":
        return None
    for name in USED:
        base = harness_base(name)
        if base is not None and issubclass(cls, base):
            return name
    return None


def recognised(item: pytest.Item) -> bool:
    return family(item) is not None and mode(item.config) == "auto"


def mismatch(name: str) -> str | None:
    """Why this torch's base class cannot be adapted (a method it no longer has), or None."""
    base = harness_base(name)
    missing = [method for method in USED[name] if base is None or not hasattr(base, method)]
    return f"{name} lacks {', '.join(missing)}" if missing else None


def assign(config: pytest.Config, items: list[pytest.Item], runtime: Runtime) -> None:
    """Give each of the harness's tests the world size it spawns (its `world_size`, read from a
    test case as its parent would make it), where that fits the run's devices; install the
    adapter once in this driver. A test that does not fit spawns as before."""
    if mode(config) == "off":
        return
    families = {item: family(item) for item in items}
    if not any(families.values()):
        return
    adapter = _installed(config, runtime)
    for item, name in families.items():
        if name is None or name in adapter.left_alone:
            continue
        world_size = _world_size(item.cls, item.name, name)
        if world_size is None or world_size > runtime.devices.count:
            adapter.unfit += 1
            continue
        item.stash[WORLD_SIZE] = world_size
        item.stash[HARNESS] = name
        item.stash[WHOLE_CLASS] = name == CONTINUOUS  # one pool, one poison pill per class
        adapter.on_gangs += 1


def _world_size(cls: Any, method: str, name: str) -> int | None:
    """The number of children the harness would spawn for the test (None: not known here)."""
    try:
        with run_devices_counted():
            if name == PER_TEST:
                return int(cls(method).world_size)
            return int(cls._get_world_size(continuous.device_type(cls)))
    except Exception:
        return None


def _installed(config: pytest.Config, runtime: Runtime) -> PyTorchHarness:
    global _active
    adapter = config.stash.get(ADAPTER, None)
    if adapter is None:
        adapter = config.stash[ADAPTER] = _active = PyTorchHarness(runtime)
        config.pluginmanager.register(adapter, "xdist-megatron-pytorch-harness")
        config.add_cleanup(_deactivate)
        for name in USED:
            why_not = mismatch(name) if harness_base(name) is not None else None
            if why_not is not None:
                adapter.left_alone.add(name)
                adapter.notes.append(f"{why_not}: its tests spawn their own processes")
        if PER_TEST not in adapter.left_alone:
            _patch(harness_base(PER_TEST))
        if CONTINUOUS not in adapter.left_alone and harness_base(CONTINUOUS) is not None:
            continuous.patch(harness_base(CONTINUOUS), _current)
    return adapter


def _deactivate() -> None:
    """The run ended: a test case run after it (pytester in-process) spawns as without us."""
    global _active
    _active = None


class PyTorchHarness(GangCaller):
    """The driver's adapter: which test runs now, and what the collection summary says."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime)
        self.on_gangs = 0  # tests collected to run on gangs
        self.unfit = 0  # collected, but their world size does not fit the run's devices
        self.fallbacks: Counter[str] = Counter()  # tests that spawned anyway, and why
        self.notes: list[str] = []
        self.left_alone: set[str] = set()  # base classes whose methods are not as expected

    def follows(self, item: pytest.Item) -> bool:
        return item.stash.get(HARNESS, None) in USED

    def parent_side(self) -> AbstractContextManager[None]:
        return run_devices_counted()  # the parent's side counts the run's devices

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        lines = [f"xdist-megatron: {self.summary()}"] if self.on_gangs or self.unfit else []
        return lines + [f"xdist-megatron: {note}" for note in self.notes]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.fallbacks:
            reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.fallbacks.items()))
            terminalreporter.line(f"xdist-megatron: {NAME} tests that spawned: {reasons}")

    def summary(self) -> str:
        text = f"{NAME}: {self.on_gangs} tests on gangs"
        if self.unfit:
            text += f", {self.unfit} spawn their own processes (world size over the devices)"
        return text

    def takes(self, case: Any) -> bool:
        """Whether `case` is the test that runs now on a gang (not a test case that one of the
        suite's tests builds and runs itself)."""
        item = self.item
        return item is not None and isinstance(case, item.cls) and case._testMethodName == item.name

    def takes_class(self, cls: type) -> bool:
        """Whether `cls` is the class of the test that runs now on a gang."""
        return self.item is not None and self.item.cls is cls

    def run(self, case: Any, fn: Callable[[], None]) -> None:
        """Every child's part on the ranks of the test's gang, then the harness's verdict."""
        from torch.testing._internal.common_distributed import get_timeout  # the suite's import

        from .pytorch_child import run_child  # what a rank imports: not in runs without harnesses

        cls = type(case)
        arguments = (
            cls.__module__,
            cls.__qualname__,
            case._current_test_name(),
            case.file_name,
            dict(os.environ),
            {"fake_pg": getattr(case, "fake_pg", False)},
        )
        started = time.time()
        world_size = self.item.stash[WORLD_SIZE]
        results = self.call(world_size, run_child, arguments, float(get_timeout(case.id())))
        failed = [r for r in results if r.outcome != PASSED] or self.clean(world_size)
        if failed:
            raise HarnessError(self.describe(failed))
        case.processes = [_Exited(r.value[2], r.value[0]) for r in results]
        case.pid_to_pipe = {r.value[2]: _Sent(r.value[1]) for r in results}
        case._check_return_codes(fn, time.time() - started)


ADAPTER = pytest.StashKey[PyTorchHarness]()
_active: PyTorchHarness | None = None  # this process's run's adapter, where it has one


def _patch(base: Any) -> None:
    """Replace the harness's two methods on its own class (once per process)."""
    if base.__dict__.get(continuous.PATCHED):
        return
    start, join = base._start_processes, base._join_processes

    def _start_processes(self: Any, proc: Any) -> None:
        adapter = _current()
        if adapter is None or not adapter.takes(self):
            return start(self, proc)
        self.processes = []
        setattr(self, PENDING, proc)  # spawned at the join, should the test need its own

    def _join_processes(self: Any, fn: Callable[[], None]) -> None:
        proc = self.__dict__.pop(PENDING, None)
        adapter = _current()
        if proc is None or adapter is None:
            return join(self, fn)
        if fn in self.skip_return_code_checks or fn in self.special_return_code_checks:
            adapter.fallbacks["check their exit codes"] += 1
            start(self, proc)
            return join(self, fn)
        return adapter.run(self, fn)

    base._start_processes, base._join_processes = _start_processes, _join_processes
    setattr(base, continuous.PATCHED, True)


def _current() -> PyTorchHarness | None:
    return _active


@dataclass
class _Exited:
    """What the harness reads of a child process that has ended."""

    pid: int
    exitcode: int

    def terminate(self) -> None:
        """tearDown ends the children it spawned; a rank outlives the test."""


@dataclass
class _Sent:
    """The parent's end of a child's pipe: the traceback the child sent, if it sent one."""

    message: str | None

    def recv(self) -> str:
        return self.message or ""

    def close(self) -> None:
        pass
