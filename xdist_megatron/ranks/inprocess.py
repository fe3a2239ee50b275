"""A rank that runs tests' protocol in its own process: a gang's rank, driven test by test by its
driver, or a rank that `torchrun -m pytest` started (the passthrough).

Both run a marked test's fixtures and body right here, with the same Megatron layouts, the same
per-test cleanup and the same care for what wider fixture scopes hold. Under torchrun every rank
runs the whole session, so it also crosses module boundaries itself; a gang's driver tells it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any

import pluggy
import pytest
from _pytest._code import Traceback

from .. import markers
from ..protocol import DEVICE_COUNT_VAR, LAYOUT, PACKAGE_DIR, WORLD_SIZE, RankInfo, module_of
from ..roles import Role, started_as
from . import agreement, megatron_layout
from .holdings import ScopeHoldings

PLUGIN_NAME = "xdist-megatron-rank"
IN_PROCESS = pytest.StashKey["InProcessRank"]()  # on a rank's config
_PLUGGY_DIR = os.path.dirname(os.path.abspath(pluggy.__file__)) + os.sep


def torchrun_rank_info() -> RankInfo | None:
    """This torchrun rank's RankInfo, or None outside torchrun."""
    if started_as() is not Role.TORCHRUN_RANK:
        return None
    import torch

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank, device)


def configure(config: pytest.Config, finish_line: Callable[[bool], bool] | None) -> InProcessRank:
    """The plugin state of a rank process, registered as its plugin: a gang's meets its peers
    at `finish_line` after each test; torchrun's has none."""
    rank = config.stash[IN_PROCESS] = InProcessRank(config, finish_line)
    config.pluginmanager.register(rank, PLUGIN_NAME)
    return rank


class InProcessRank:
    """pytest plugin of a rank process: set up before each of its tests, clean after. The rank
    role's runtime: what its collection and fixtures ask of the process."""

    def __init__(self, config: pytest.Config, finish_line: Callable[[bool], bool] | None) -> None:
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.default_world_size = markers.default_world_size(config)
        self.holdings = ScopeHoldings(self._rebase)
        config.pluginmanager.register(self.holdings, "xdist-megatron-holdings")
        # On a gang: a barrier through the driver's store that every rank passes once its test
        # is over, before the collective cleanup (so the cleanup never meets a peer's collective);
        # it says whether the test failed on any rank.
        self._finish_line = finish_line
        self._failed = False  # the running test raised here (in setup, call or teardown)
        self._meet = False  # under torchrun: this test's ranks meet after it (see setup)
        self._meetings = 0  # under torchrun: agreements reached through the default store
        self._startup: Any = None
        self._module: str | None = None
        self._layout: Any = None
        self._poisoned = False  # a CUDA error surfaced: this process is of no further use
        self._groups_at_last_destroy = 0

    @property
    def on_gang(self) -> bool:
        return self._finish_line is not None

    @property
    def device_count(self) -> int:
        """The devices "all" means: on a gang its driver's (so every rank resolves it alike),
        under torchrun its world."""
        return int(os.environ[DEVICE_COUNT_VAR]) if self.on_gang else self.world_size

    def unfit(self, world_size: int) -> str | None:
        """Why a test of this size cannot run here: under torchrun, another world size (on a
        gang its driver chose the test)."""
        if self.on_gang or world_size == self.world_size:
            return None
        return f"needs world size {world_size}, torchrun started {self.world_size}"

    def assigned(self, items: list[pytest.Item]) -> None:
        """Nothing to tell: a rank's driver schedules its tests."""

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_set_timer(self) -> bool | None:
        """pytest-timeout: no timer on a gang's rank (its driver's covers every rank)."""
        return True if self.on_gang else None

    @pytest.hookimpl(optionalhook=True, tryfirst=True)
    def pytest_timeout_cancel_timer(self) -> bool | None:
        return True if self.on_gang else None

    def applies(self, item: pytest.Item) -> bool:
        """Every test a gang sends runs here; under torchrun, the tests with a world size."""
        return self.on_gang or WORLD_SIZE in item.stash

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, None, None]:
        self._failed = False  # each test starts unfailed, after one the plugin leaves alone too
        # Under torchrun, whether the ranks meet after this test: from what they all share
        # before it, not from what it leaves (a rank whose setup failed has no layout).
        self._meet = self._layout is not None or LAYOUT in item.stash
        if self.applies(item) and not self.on_gang:
            self._enter_module(module_of(item.nodeid))
        with self._noting_failure():
            result = yield  # skip markers evaluated and fixtures set up: the test will run
            if self.applies(item):
                self._switch_layout(item)  # a build that fails on one rank fails the test
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        """An asynchronous CUDA error of the body (a device-side assert) fails the body."""
        __tracebackhide__ = True
        with self._noting_failure():
            result = yield
        if self.applies(item):
            import torch

            if torch.cuda.is_initialized():
                try:
                    torch.cuda.synchronize()
                except Exception:
                    # Sticky: the rest of the cleanup would only raise it again in teardown;
                    # the health check after the test retires the gang.
                    self._poisoned = True
                    raise
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        __tracebackhide__ = True
        try:
            with self._noting_failure():
                return (yield)
        finally:
            if self.applies(item):
                self._after_test()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """A failure shows what it shows without this plugin: its hook wrappers only passed the
        error on (pytest hides its own frames so, and `--full-trace` shows them all)."""
        if call.excinfo is not None and not item.config.getoption("fulltrace", False):
            passed_on = _without_passing_frames(call.excinfo.tb)
            if passed_on is not None:
                call.excinfo.traceback = Traceback(passed_on)
        return (yield)

    @contextlib.contextmanager
    def _noting_failure(self) -> Generator[None, None, None]:
        """Note that the test raised (a skip is no failure), for its layout's sake."""
        try:
            yield
        except pytest.skip.Exception:
            raise
        except BaseException:
            self._failed = True
            raise

    def _enter_module(self, module: str) -> None:
        """Under torchrun: join the group, and reset when the test's module is a new one (the
        last module's scopes ended with its last test)."""
        from . import isolation

        self._join()
        if self._startup is None:
            self._startup = isolation.snapshot()
        if self._module not in (None, module):
            self.reset()
        self._module = module

    def _switch_layout(self, item: pytest.Item) -> None:
        kept, self._layout = self._layout, None  # None until done: never keep a half-built state
        wanted = item.stash.get(LAYOUT, None)
        self._layout = megatron_layout.switch(wanted, kept, self.holdings.groups)

    def _after_test(self) -> None:
        __tracebackhide__ = True
        from . import isolation

        if self._poisoned:
            if not self.on_gang:  # nothing retires this rank: its peers still meet
                self._agree_failed(True)
            return
        if self._agree_failed(self._failed):
            self._layout = None  # a failed test may have left it half-changed: built again
        isolation.cleanup_after_job(
            keep_groups=self.holdings.groups,
            keep_megatron=self._layout is not None,
            keep_libraries=self.holdings.megatron,
            destroy_groups=self._groups_over_limit(),
        )

    def _agree_failed(self, failed: bool) -> bool:
        """Whether the test failed on any rank, the same answer on every rank (on a gang, at its
        finish line). Under torchrun only a layout needs the answer: through the store of
        torchrun's group, which the layout's tests joined, bounded by that store's timeout."""
        if self._finish_line is not None:
            return self._finish_line(failed)
        import torch.distributed as dist

        if not self._meet or not dist.is_initialized():
            return failed
        self._meetings += 1
        store = dist.distributed_c10d._get_default_store()
        return agreement.meet(
            store, f"xdist-megatron/failed/{self._meetings}", self.world_size, failed
        )

    def _groups_over_limit(self) -> bool:
        """Whether the groups made since they were last destroyed are too many to keep (decided
        alike on every rank: the destruction is collective)."""
        from . import isolation

        made = isolation.groups_made()
        if made - self._groups_at_last_destroy <= isolation.GROUP_LIMIT:
            return False
        self._groups_at_last_destroy = made
        return True

    def reset(self) -> None:
        """Module boundary (the module's own scopes already ended): back to the start-up state,
        keeping what live session fixtures hold."""
        from . import isolation

        self._layout = None
        held = self.holdings
        isolation.cleanup_after_job(held.groups, keep_libraries=held.megatron)
        if self._startup is not None:
            isolation.restore(self._startup)
        self._groups_at_last_destroy = isolation.groups_made()

    def set_startup(self, startup: Any) -> None:
        self._startup = startup

    def _rebase(self, before: Any, after: Any) -> None:
        """A session fixture was set up: what it changed is part of the state modules start
        from (what earlier tests leaked is not)."""
        from . import isolation

        if self._startup is not None:
            self._startup = isolation.rebase(self._startup, before, after)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """The `gang.run` of torchrun: call here, gather every rank's value."""
        import torch.distributed as dist

        self._join()
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, fn(*args, **kwargs))
        return values

    def _join(self) -> None:
        """Under torchrun: join torchrun's group unless the suite's own code already did."""
        import torch
        import torch.distributed as dist

        # As on a gang: the devices of this node's ranks, so a test can tell where it ran.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        os.environ.setdefault("XDIST_MEGATRON_DEVICES", ",".join(map(str, range(local))))
        if dist.is_initialized():
            return
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("cpu:gloo,cuda:nccl")
        else:
            dist.init_process_group("gloo")


def _without_passing_frames(tb: TracebackType) -> TracebackType | None:
    """`tb` less the frames of this plugin that only passed an error on (a hook wrapper's: pluggy
    called it, it called pluggy again) and pluggy's call into each, as new traceback objects:
    the exception keeps its own (a wider fixture raises it again for later tests), and
    `--tb=native` prints from the new chain. None when no frame passed the error on."""
    entries: list[TracebackType] = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    kept: list[TracebackType] = []
    for entry, inner in itertools.pairwise([*entries, None]):
        if inner is not None and _in(entry, PACKAGE_DIR) and _in(inner, _PLUGGY_DIR):
            if kept and _in(kept[-1], _PLUGGY_DIR):
                kept.pop()
        else:
            kept.append(entry)
    if len(kept) == len(entries):
        return None
    chain = None
    for entry in reversed(kept):
        chain = TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain


def _in(entry: TracebackType, folder: str) -> bool:
    return os.path.abspath(entry.tb_frame.f_code.co_filename).startswith(folder)
