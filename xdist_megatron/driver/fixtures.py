"""The fixtures a test author requests: `rank`, `world_size`, `local_rank`, `device` (on a rank,
its own; in a driver, rank 0 of a world of 1) and `gang`, whose handle calls functions on every
rank of the test's gang from a test body that stays in the driver."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from .. import markers
from ..protocol import FAILED, WORLD_SIZE, CleanupJob, RankInfo, module_of
from ..ranks.inprocess import IN_PROCESS
from ..roles import role_of
from .gang import Gang, GangError
from .runtime import RUNTIME, Runtime
from .timeouts import default_timeout, timeout_of
from .zygote_client import ZygoteError


def _rank_info(request: pytest.FixtureRequest) -> RankInfo | None:
    """This process's rank on a gang or under torchrun; None in a driver (which is rank 0 of a
    world of 1)."""
    if not role_of(request.config).is_rank:
        return None
    from ..ranks.rank import rank_info

    return rank_info()


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> int:
    """This rank's global rank (0 in the driver)."""
    info = _rank_info(request)
    return info.rank if info else 0


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """Number of ranks in the test's gang (1 in the driver)."""
    info = _rank_info(request)
    return info.world_size if info else 1


@pytest.fixture
def local_rank(request: pytest.FixtureRequest) -> int:
    """This rank's index on its host (0 in the driver)."""
    info = _rank_info(request)
    return info.local_rank if info else 0


@pytest.fixture
def device(request: pytest.FixtureRequest) -> Any:
    """torch.device of this rank: its own GPU, or the CPU."""
    info = _rank_info(request)
    if info:
        return info.device
    import torch  # only here: the other rank fixtures must not make a driver import torch

    is_cuda = request.config.stash[RUNTIME].devices.is_cuda
    return torch.device("cuda", 0) if is_cuda else torch.device("cpu")


class GangHandle:
    """The `gang` fixture: call importable functions on every rank of the test's gang."""

    def __init__(self, item: pytest.Item, world_size: int) -> None:
        self._item = item
        self.world_size = world_size
        self._here = item.config.stash.get(IN_PROCESS, None)  # on a rank: the test runs here
        self._gang: Gang | None = None

    @property
    def _runtime(self) -> Runtime:
        return self._item.config.stash[RUNTIME]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank; the per-rank return values in rank order."""
        if self._here is not None:
            return self._here.run(fn, *args, **kwargs)
        with self._devices_held():
            self._gang = self._acquire()
            return self._gang.run(fn, *args, **kwargs)

    def finish(self) -> None:
        """After the test: the per-job cleanup on each rank (a failure retires the gang)."""
        gang, self._gang = self._gang, None
        if gang is None or not gang.alive:
            return
        with self._devices_held():
            results = gang.execute(CleanupJob(), default_timeout(self._runtime.config))
        failed = [r for r in results if r.outcome == FAILED]
        if failed:
            raise GangError(
                f"cleanup after the test failed on rank {failed[0].rank}: "
                f"{failed[0].message}\n{failed[0].longrepr}"
            )

    def _prepare(self) -> None:
        """In the fixture's setup, as a worker pool is spawned in the fixture that makes it: the
        zygote's imports, the gang's start and a module boundary's reset, which in the call
        counted against a timeout of the call alone (pytest-timeout's `timeout_func_only`). A
        gang that cannot start fails the setup with why, without the plugin's frames."""
        if self._here is not None:
            return
        try:
            self._runtime.pool.prepare(self.world_size)
            with self._devices_held():
                self._gang = self._acquire()
        except (GangError, ZygoteError) as exc:
            pytest.fail(str(exc), pytrace=False)

    def _acquire(self) -> Gang:
        """The gang of the test's size, reset if the test's module is new to it."""
        module = module_of(self._item.nodeid)
        return self._runtime.pool.acquire(self.world_size, module, timeout_of(self._item))

    def _devices_held(self) -> AbstractContextManager[None]:
        return self._runtime.pool.devices_held(self.world_size, markers.is_exclusive(self._item))


@pytest.fixture
def gang(request: pytest.FixtureRequest) -> Generator[GangHandle, None, None]:
    """Run functions on the ranks of the test's gang from a test body that stays in the driver."""
    world_size = request.node.stash.get(WORLD_SIZE, None)
    if world_size is None:
        pytest.fail("the gang fixture needs @pytest.mark.world_size(N) on the test", pytrace=False)
    handle = GangHandle(request.node, world_size)
    handle._prepare()
    yield handle
    handle.finish()
