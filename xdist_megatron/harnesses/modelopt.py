"""Model-Optimizer's `spawn_multiprocess_job(size, job, backend)` on gangs.

Model-Optimizer's tests call this helper of their own (`tests/_test_utils/torch/distributed/
utils.py`) from a test body: it spawns `size` fresh processes, each joining a process group and
calling `job(rank, size)`, then joins them with no timeout and asserts that every exit code is
0. Where the suite imported the helper, the driver replaces it, in its module and in every
module that imported the name: the job runs on a gang of `size` (`modelopt_child.run_job`, as
the spawned process would run it), under the test's timeout; a job that raised fails the test
with every failing rank's traceback, and the per-job cleanup resets what the job left. A size
over the run's devices, or a job that cannot be pickled by reference, spawns as before.
"""

from __future__ import annotations

import inspect
import pickle
import socket
import sys
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from ..driver.timeouts import timeout_of
from ..protocol import HARNESS, PASSED, WORLD_SIZE
from .on_gangs import GangCaller, HarnessError, mode

if TYPE_CHECKING:
    from ..driver.runtime import Runtime

NAME = "Model-Optimizer spawn_multiprocess_job"
HELPER_MODULE = "_test_utils.torch.distributed.utils"
FUNCTION = "spawn_multiprocess_job"
PARAMETERS = ("size", "job", "backend")
ADAPTER = pytest.StashKey["ModelOptHarness"]()


def helper() -> Callable[..., Any] | None:
    """The suite's `spawn_multiprocess_job`, where the suite imported it."""
    function = getattr(sys.modules.get(HELPER_MODULE), FUNCTION, None)
    return function if callable(function) else None


def recognised(config: pytest.Config) -> bool:
    return helper() is not None and mode(config) == "auto"


def install(config: pytest.Config, runtime: Runtime) -> None:
    """Replace the helper wherever the suite's modules hold it (once per driver)."""
    original = helper()
    if not recognised(config) or runtime.inprocess is not None or ADAPTER in config.stash:
        return
    adapter = config.stash[ADAPTER] = ModelOptHarness(runtime, original)
    config.pluginmanager.register(adapter, "xdist-megatron-modelopt-harness")
    parameters = tuple(inspect.signature(original).parameters)
    if parameters != PARAMETERS:
        adapter.note = f"{FUNCTION}{parameters} is not ({', '.join(PARAMETERS)})"
        return
    replaced = _replace(original, adapter.spawn)
    config.add_cleanup(lambda: _replace(adapter.spawn, original, among=replaced))


def _replace(
    old: Callable[..., Any], new: Callable[..., Any], among: list[Any] | None = None
) -> list[Any]:
    """Set `new` where a module holds `old` under the helper's name; the modules changed."""
    modules = among if among is not None else list(sys.modules.values())
    changed = []
    for module in modules:
        if getattr(module, "__dict__", {}).get(FUNCTION) is old:
            setattr(module, FUNCTION, new)
            changed.append(module)
    return changed


class ModelOptHarness(GangCaller):
    """The driver's adapter: runs the helper's jobs on gangs, and counts them."""

    def __init__(self, runtime: Runtime, original: Callable[..., Any]) -> None:
        super().__init__(runtime)
        self.original = original
        self.note = ""  # why the helper was left alone
        self.jobs = 0
        self.spawned: Counter[str] = Counter()

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        if self.note:
            return [f"xdist-megatron: {self.note}: its jobs spawn their own processes"]
        return [f"xdist-megatron: {NAME}: its jobs run on gangs"]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        text = f"xdist-megatron: {NAME}: {self.jobs} jobs on gangs"
        if self.spawned:
            text += "; spawned: " + ", ".join(f"{n} {why}" for why, n in self.spawned.items())
        if self.jobs or self.spawned:
            terminalreporter.line(text)

    def spawn(self, size: int, job: Callable[[int, int], Any], backend: str = "gloo") -> None:
        """The helper's contract, on a gang of `size`."""
        __tracebackhide__ = True
        why_not = self._unfit(size, job)
        if why_not:
            self.spawned[why_not] += 1
            return self.original(size, job, backend)
        from .modelopt_child import run_job  # what a rank imports: not in runs without it

        item = self.item
        assert item is not None
        item.stash[HARNESS] = FUNCTION
        item.stash.setdefault(WORLD_SIZE, size)
        self.jobs += 1
        results = self.call(size, run_job, (job, backend, _free_port()), timeout_of(item))
        failed = [result for result in results if result.outcome != PASSED]
        if not any(result.lost for result in failed):  # every rank finished: keep the gang
            failed += self.clean(size)
        if failed:
            ranks = ", ".join(str(result.rank) for result in failed)
            raise HarnessError(f"the job failed on rank(s) {ranks}\n{self.describe(failed)}")
        return None

    def _unfit(self, size: int, job: Any) -> str:
        if self.item is None:
            return "outside a test"
        if not 0 < size <= self.runtime.devices.count:
            return "size over the devices"
        try:
            pickle.dumps(job)
        except Exception:
            return "jobs not importable"
        return ""


def _free_port() -> int:
    """A port for the job's own group, where the gang's cannot serve its backend."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]
