"""Model-Optimizer's `spawn_multiprocess_job(size, job, backend)` and `DistributedWorkerPool`
on gangs.

Model-Optimizer's tests call this helper of their own (`tests/_test_utils/torch/distributed/
utils.py`) from a test body: it spawns `size` fresh processes, each joining a process group and
calling `job(rank, size)`, then joins them with no timeout and asserts that every exit code is
0. Where the suite imported the helper, the driver replaces it, in its module and in every
module that imported the name: the job runs on a gang of `size` (`modelopt_child.run_job`, as
the spawned process would run it), under the test's timeout; a job that raised fails the test
with every failing rank's traceback, and the per-job cleanup resets what the job left. A size
over the run's devices, or a job that cannot be pickled by reference, spawns as before.

`DistributedWorkerPool(world_size, backend, teardown_fn)` (its GPU lanes' pools, made by fixtures
per session or module) spawns its workers once and runs `fn(rank, world_size, *args)` on each
at every `run`, then `teardown_fn`. Its replacement keeps that contract on the gang of
`world_size` of the test that calls `run`; `shutdown` has nothing to end.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import sys
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from ..driver.timeouts import timeout_of
from ..protocol import GANGS_AT_CALL, HARNESS, WORLD_SIZE
from .on_gangs import GangCaller, free_port, mode

if TYPE_CHECKING:
    from ..driver.runtime import Runtime

NAME = "Model-Optimizer spawn_multiprocess_job"
HELPER_MODULE = "_test_utils.torch.distributed.utils"
FUNCTION = "spawn_multiprocess_job"
POOL = "DistributedWorkerPool"
PARAMETERS = {FUNCTION: ("size", "job", "backend"), POOL: ("world_size", "backend", "teardown_fn")}
ADAPTER = pytest.StashKey["ModelOptHarness"]()


def helper() -> Callable[..., Any] | None:
    """The suite's `spawn_multiprocess_job`, where the suite imported it."""
    function = getattr(sys.modules.get(HELPER_MODULE), FUNCTION, None)
    return function if callable(function) else None


def recognised(config: pytest.Config) -> bool:
    return helper() is not None and mode(config) == "auto"


def install(config: pytest.Config, runtime: Runtime) -> None:
    """Replace the helper and the pool wherever the suite's modules hold them (once per
    driver); a name whose parameters are not the expected ones is left alone, with a note."""
    if not recognised(config) or ADAPTER in config.stash:
        return
    module = sys.modules[HELPER_MODULE]
    adapter = config.stash[ADAPTER] = ModelOptHarness(runtime)
    config.stash[GANGS_AT_CALL] = True  # the test bodies that call the helpers ask for gangs
    config.pluginmanager.register(adapter, "xdist-megatron-modelopt-harness")
    replacements = {FUNCTION: adapter.spawn, POOL: pool_on_gangs(adapter)}
    for name, new in replacements.items():
        old = getattr(module, name, None)
        if old is None:
            continue
        found = tuple(inspect.signature(old).parameters)
        if found != PARAMETERS[name]:
            adapter.notes.append(f"{name}{found} is not ({', '.join(PARAMETERS[name])})")
            continue
        adapter.originals[name] = old
        replaced = _replace(name, old, new, _holders(config))
        config.add_cleanup(functools.partial(_replace, name, new, old, replaced))


def _holders(config: pytest.Config) -> list[Any]:
    """The modules that may hold the helper's names: those imported, and the conftest files
    pytest loaded, also where a later one of the same name took `conftest` out of
    `sys.modules` (pytest's default import mode, for conftest files outside packages)."""
    modules = {id(m): m for m in list(sys.modules.values()) if m is not None}
    for plugin in config.pluginmanager.get_plugins():
        if isinstance(plugin, ModuleType):
            modules.setdefault(id(plugin), plugin)
    return list(modules.values())


def _replace(name: str, old: Any, new: Any, modules: list[Any]) -> list[Any]:
    """Set `new` where one of `modules` holds `old` as `name`; the modules changed."""
    changed = []
    for module in modules:
        if getattr(module, "__dict__", {}).get(name) is old:
            setattr(module, name, new)
            changed.append(module)
    return changed


class ModelOptHarness(GangCaller):
    """The driver's adapter: runs the helper's jobs on gangs, and counts them."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(runtime)
        self.originals: dict[str, Any] = {}  # the suite's own helpers, by name
        self.notes: list[str] = []  # names left alone, and why
        self.jobs = 0
        self.spawned: Counter[str] = Counter()

    def pytest_report_collectionfinish(self, config: pytest.Config) -> list[str]:
        lines = [f"xdist-megatron: {note}: it spawns its own processes" for note in self.notes]
        return lines or [f"xdist-megatron: {NAME}: its jobs run on gangs"]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        text = f"xdist-megatron: {NAME}: {self.jobs} jobs on gangs"
        if self.spawned:
            text += "; spawned: " + ", ".join(f"{n} {why}" for why, n in self.spawned.items())
        if self.jobs or self.spawned:
            terminalreporter.line(text)

    def spawn(self, size: int, job: Callable[[int, int], Any], backend: str = "gloo") -> None:
        """The helper's contract, on a gang of `size`."""
        __tracebackhide__ = True
        why_not = self.unfit(size, job)
        if why_not:
            self.spawned[why_not] += 1
            return self.originals[FUNCTION](size, job, backend)
        from .modelopt_child import run_job  # what a rank imports: not in runs without it

        self.run_on_gang(size, run_job, (job, backend, free_port(), dict(os.environ)))
        return None

    def run_on_gang(self, size: int, fn: Callable[..., Any], arguments: tuple) -> None:
        """`fn(*arguments)` on a gang of `size`, then the cleanup; a failure on any rank
        fails the test with each failing rank's traceback."""
        __tracebackhide__ = True
        item = self.item
        assert item is not None
        item.stash[HARNESS] = FUNCTION
        item.stash.setdefault(WORLD_SIZE, size)
        self.jobs += 1
        self.call_and_clean(size, fn, arguments, timeout_of(item), "the job")

    def unfit(self, size: int, job: Any) -> str:
        """Why a job of `size` spawns as without the plugin (empty: it runs on a gang)."""
        if self.item is None:
            return "outside a test"
        if not 0 < size <= self.runtime.devices.count:
            return "size over the devices"
        try:
            pickle.dumps(job)
        except Exception:
            return "jobs not importable"
        return ""


def pool_on_gangs(adapter: ModelOptHarness) -> type:
    """`DistributedWorkerPool`'s contract on the gangs of `adapter`'s driver."""

    class DistributedWorkerPool:
        def __init__(
            self, world_size: int, backend: str = "nccl", teardown_fn: Any = _DEFAULT
        ) -> None:
            original = adapter.originals[POOL]
            if teardown_fn is _DEFAULT:
                teardown_fn = inspect.signature(original).parameters["teardown_fn"].default
            self.world_size, self.backend, self.teardown_fn = world_size, backend, teardown_fn
            why_not = adapter.unfit(world_size, teardown_fn)
            self._spawned = original(world_size, backend, teardown_fn) if why_not else None
            if why_not:
                adapter.spawned[why_not] += 1

        def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            """`fn(rank, world_size, *args, **kwargs)` on every rank, then `teardown_fn`."""
            __tracebackhide__ = True
            if self._spawned is not None:
                return self._spawned.run(fn, *args, **kwargs)
            from .modelopt_child import run_in_pool

            port, environ = free_port(), dict(os.environ)
            arguments = (fn, args, kwargs, self.backend, self.teardown_fn, port, environ)
            return adapter.run_on_gang(self.world_size, run_in_pool, arguments)

        def shutdown(self) -> None:
            if self._spawned is not None:
                self._spawned.shutdown()

    return DistributedWorkerPool


_DEFAULT = object()
