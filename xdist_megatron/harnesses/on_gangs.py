"""What every adapted harness does in the driver: call its child's side on the ranks of a gang
of the size it would have spawned, show the ranks' output where the children's would go, and
run the per-job cleanup afterwards."""

from __future__ import annotations

import pickle
import socket
import sys
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import pytest

from .. import markers
from ..protocol import PASSED, CallJob, CleanupJob, Job, RankResult, module_of

if TYPE_CHECKING:
    from ..driver.runtime import Runtime

CLEANUP_TIMEOUT = 60.0
MODES = ("auto", "off")


def mode(config: pytest.Config) -> str:
    """--megatron-harnesses, else ini megatron_harnesses: auto (default) or off."""
    value = config.getoption("megatron_harnesses") or config.getini("megatron_harnesses")
    if value not in MODES:
        raise pytest.UsageError(f"--megatron-harnesses must be auto or off, got {value!r}")
    return value


class HarnessError(RuntimeError):
    """A rank of the test's gang died, hung or failed outside the child's own code."""


class GangCaller:
    """A harness adapter's calls onto gangs, for the test that runs now (`item`)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.item: pytest.Item | None = None

    def follows(self, item: pytest.Item) -> bool:
        """Whether `item` is one of this harness's tests (kept as the test that runs now)."""
        return True

    def parent_side(self) -> AbstractContextManager[None]:
        """What holds while a followed test runs its parent's side in the driver."""
        return nullcontext()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, Any, Any]:
        if not self.follows(item):
            return (yield)
        self.item = item
        try:
            with self.parent_side():
                return (yield)
        finally:
            self.item = None

    @staticmethod
    def describe(failed: list[RankResult]) -> str:
        """Ranks that died, hung or failed outside the child's code: what happened, with
        their stacks, as a failed `gang.run` says it."""
        from ..driver.gang import rank_failure  # here: every run imports this module

        return "\n".join(rank_failure(result) for result in failed)

    def call(
        self, world_size: int, fn: Callable[..., Any], arguments: tuple, timeout: float
    ) -> list[RankResult]:
        """`fn(*arguments)` (a child's side, importable on a rank) on every rank of a gang of
        `world_size`; the ranks' results, their output shown as a child's would be."""
        main_path = getattr(sys.modules["__main__"], "__file__", None)
        payload = pickle.dumps((fn, arguments, {}))
        return self._execute(world_size, CallJob(payload, list(sys.path), main_path), timeout)

    def call_and_clean(
        self, world_size: int, fn: Callable[..., Any], arguments: tuple, timeout: float, what: str
    ) -> list[RankResult]:
        """`call`, then the per-job cleanup where every rank finished (a rank lost takes its
        gang with it); a failure on any rank fails the test with each failing rank's traceback,
        naming `what` failed."""
        __tracebackhide__ = True
        results = self.call(world_size, fn, arguments, timeout)
        failed = [result for result in results if result.outcome != PASSED]
        if not any(result.lost for result in failed):  # every rank finished: keep the gang
            failed += self.clean(world_size)
        if failed:
            ranks = ", ".join(str(result.rank) for result in failed)
            raise HarnessError(f"{what} failed on rank(s) {ranks}\n{self.describe(failed)}")
        return results

    def clean(self, world_size: int) -> list[RankResult]:
        """The per-job cleanup on the gang (it restores the gang's default group)."""
        results = self._execute(world_size, CleanupJob(), CLEANUP_TIMEOUT)
        return [result for result in results if result.outcome != PASSED]

    def _execute(self, world_size: int, job: Job, timeout: float) -> list[RankResult]:
        item = self.item
        assert item is not None
        module, exclusive = module_of(item.nodeid), markers.is_exclusive(item)
        results = self.runtime.pool.execute(world_size, module, job, timeout, exclusive)
        results.sort(key=lambda result: result.rank)
        _show_output(results)
        return results


def _show_output(results: list[RankResult]) -> None:
    """The children's output (in rank order), where a spawned child's would go: the driver's,
    which pytest captures for the test's report."""
    for result in results:
        if result.stdout:
            sys.stdout.write(result.stdout)
        if result.stderr:
            sys.stderr.write(result.stderr)


def free_port() -> int:
    """A port for a job's own group, where the gang's cannot serve it (the harness's child
    would have had a fresh one)."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]
