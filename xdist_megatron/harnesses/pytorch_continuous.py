"""PyTorch's `MultiProcContinuousTest` on gangs: the gang of the class's world size stands for
the class's pool of workers.

Under plain pytest the class's first `setUp` spawns `world_size` workers (`_spawn_processes`).
Each joins a process group from the class's rendezvous file once, then runs the tests it is sent
through its task queue and answers on its completion queue: the test's id, a `SkipTest`, or the
exception, which sets the class's poison pill (its later tests skip). Here `_spawn_processes`
gives the class queues of ours instead: the test id `setUp` puts in them runs on the gang when
the harness's wrapper reads the first answer (`pytorch_child.run_continuous`), and each rank's
answer is read from that job's result; the `None` of `tearDownClass` ends the class's group on
the ranks and gives the gang its own default group back. The rest is the harness's own code:
the wrapper, the poison pill, the skips.
"""

from __future__ import annotations

import os
import tempfile
import unittest
from collections.abc import Callable
from typing import Any, Protocol

from ..protocol import PASSED, RankResult

PATCHED = "_xdist_megatron_patched"  # on a base class of the harness, once replaced
END_TIMEOUT = 60.0


class Adapter(Protocol):
    """What this module needs of the driver's adapter (`pytorch.PyTorchHarness`)."""

    def takes_class(self, cls: type) -> bool: ...

    def call(
        self, world_size: int, fn: Callable[..., Any], arguments: tuple, timeout: float
    ) -> list: ...

    def clean(self, world_size: int) -> list[RankResult]: ...

    def describe(self, failed: list[RankResult]) -> str: ...


def device_type(cls: Any) -> str:
    """The class's device type, read as the harness reads it before it spawns."""
    attribute = cls.__dict__.get("device_type", cls.device_type)
    if isinstance(attribute, classmethod):
        return attribute.__func__(cls)
    if isinstance(attribute, property):
        return attribute.fget(cls)
    return attribute() if callable(attribute) else attribute


def patch(base: Any, current: Callable[[], Adapter | None]) -> None:
    """Replace `_spawn_processes` on the harness's own class (once per process)."""
    if base.__dict__.get(PATCHED):
        return
    spawn = base.__dict__["_spawn_processes"].__func__

    def _spawn_processes(cls: Any, world_size: int) -> None:
        adapter = current()
        if adapter is None or not adapter.takes_class(cls):
            return spawn(cls, world_size)
        with tempfile.NamedTemporaryFile(delete=False) as f:
            cls.rdvz_file = f.name
        workers = _Workers(adapter, cls, int(world_size))
        cls.processes = [_Worker(rank) for rank in range(workers.size)]
        cls.task_queues = [_Tasks(workers, rank) for rank in range(workers.size)]
        cls.completion_queues = [_Answers(workers, rank) for rank in range(workers.size)]

    base._spawn_processes = classmethod(_spawn_processes)
    setattr(base, PATCHED, True)


class _Workers:
    """The class's workers, as ranks of the gang of the test that runs now."""

    def __init__(self, adapter: Adapter, cls: Any, size: int) -> None:
        self.adapter, self.cls, self.size = adapter, cls, size
        self.environ = dict(os.environ)  # a spawned worker's: the parent's at the spawn
        self.sent: list[str | None] = [None] * size
        self.answers: list[Any] = []

    def put(self, rank: int, test_id: str | None) -> None:
        self.sent[rank] = test_id
        if test_id is None and rank == self.size - 1:
            self._end()

    def get(self, rank: int) -> Any:
        if rank == 0 or not self.answers:
            self.answers = self._run(self.sent[0])
        return self.answers[rank]

    def _run(self, test_id: str | None) -> list[Any]:
        from torch.testing._internal.common_distributed import get_timeout  # the suite's import

        from .pytorch_child import run_continuous

        cls = self.cls
        arguments = (cls.__module__, cls.__qualname__, cls.rdvz_file, self.size, test_id)
        timeout = float(get_timeout(test_id or ""))
        results = self.adapter.call(self.size, run_continuous, (*arguments, self.environ), timeout)
        return [self._answer(result) for result in results]

    def _answer(self, result: RankResult) -> Any:
        if result.outcome != PASSED:  # the rank died, hung, or failed outside the test
            return RuntimeError(self.adapter.describe([result]))
        kind, text = result.value
        if kind == "skip":
            return unittest.SkipTest(text)
        if kind == "error":
            return RuntimeError(f"Exception in worker process:\n{text}")
        return text

    def _end(self) -> None:
        from .pytorch_child import end_continuous

        self.adapter.call(self.size, end_continuous, (self.cls.rdvz_file,), END_TIMEOUT)
        self.adapter.clean(self.size)


class _Worker:
    """What the harness reads of a worker process: alive until the class ends."""

    def __init__(self, rank: int) -> None:
        self.pid, self.exitcode = rank, None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout: float | None = None) -> None:
        """tearDownClass waits for the workers; ranks outlive the class."""


class _Tasks:
    def __init__(self, workers: _Workers, rank: int) -> None:
        self.workers, self.rank = workers, rank

    def put(self, test_id: str | None) -> None:
        self.workers.put(self.rank, test_id)


class _Answers:
    def __init__(self, workers: _Workers, rank: int) -> None:
        self.workers, self.rank = workers, rank

    def get(self, timeout: float | None = None) -> Any:
        return self.workers.get(self.rank)

    def empty(self) -> bool:
        return True
