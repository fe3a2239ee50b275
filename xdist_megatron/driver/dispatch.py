"""The driver's side of a test that runs on a gang: send its identity, log what its ranks did.

The driver runs none of the test's protocol itself, as xdist's controller runs none of its
workers' tests: it logs the start, sends the node id to the gang, and logs one report per phase,
merged from the ranks' reports.
"""

from __future__ import annotations

import importlib
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from .. import markers
from ..protocol import WORLD_SIZE, TestJob, module_of
from . import rank_reports
from .gang import GangError
from .zygote_client import ZygoteError

if TYPE_CHECKING:
    from .runtime import Runtime


class GangWarning(UserWarning):
    """Something a gang repaired or replaced while running a test."""


class GangDispatch:
    """pytest plugin of a driver: runs the protocol of the tests that belong on gangs."""

    def __init__(self, runtime: Runtime, timeout_of: Callable[[pytest.Item], float]) -> None:
        self.runtime = runtime
        self.timeout_of = timeout_of

    def pytest_keyboard_interrupt(self) -> None:
        """Ctrl-C, or a CI runner's SIGINT to the xdist controller: end every rank now (the
        zygote kills them all), before xdist waits for its workers to stop."""
        self.runtime.close(at_once=True)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool:
        if not self.runtime.runs_on_ranks(item):
            return None  # type: ignore[return-value]
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        reports = self._run(item, nextitem)
        _end_driver_scopes(item, nextitem, reports[-1])
        for report in reports:
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _run(self, item: pytest.Item, nextitem: pytest.Item | None) -> list[pytest.TestReport]:
        runtime = self.runtime
        world_size = item.stash[WORLD_SIZE]
        runtime.trim_gangs(world_size)
        job = TestJob(
            nodeid=item.nodeid,
            module_path=str(item.path),
            next_nodeid=runtime.next_on_gang(item, nextitem),
            session=runtime.session_args(),
            capture=item.config.getoption("capture", "fd") != "no",
        )
        try:
            module = module_of(item.nodeid)
            timeout = self.timeout_of(item)
            exclusive = markers.is_exclusive(item)
            results = runtime.pool.execute(world_size, module, job, timeout, exclusive)
        except (GangError, ZygoteError) as exc:  # no gang: say why, without our own frames
            return rank_reports.no_gang(item, str(exc))
        for result in results:
            if result.note:
                _say(item, f"rank {result.rank}: {result.note}")
        _forward_warnings(item, results)
        reports = rank_reports.merge(item, results)
        pool = runtime.pool
        rank_reports.add_sharing(reports, pool.sharing, pool.locks.slots)
        return reports


def _end_driver_scopes(
    item: pytest.Item, nextitem: pytest.Item | None, teardown: pytest.TestReport
) -> None:
    """What the driver keeps set up for the tests that run here (fixtures of unmarked tests and
    of the `gang` style) ends where `nextitem` does not share it, as after a local test; an error
    there fails this test's teardown, as it would locally."""
    try:
        item.session._setupstate.teardown_exact(nextitem)
    except Exception:
        text = traceback.format_exc()
        if teardown.failed:
            teardown.sections.append(("teardown of the driver's fixtures", text))
        else:
            teardown.outcome, teardown.longrepr = "failed", text


def _say(item: pytest.Item, text: str) -> None:
    """A warning of the test, in pytest's warnings summary (xdist forwards it too)."""
    path, lineno, _ = item.location
    _record(item, warnings.WarningMessage(GangWarning(text), GangWarning, path, (lineno or 0) + 1))


def _forward_warnings(item: pytest.Item, results: list[Any]) -> None:
    """The warnings the test raised on its ranks, each as often as one rank raised it (every
    rank raises the same ones): what torchrun's rank 0 shows. A warning raised again at the same
    line counts each time, as pytest counts it (torch.jit.script warns once per function it
    compiles, from one line of torch's)."""
    counts: Counter[tuple] = Counter()
    for result in results:
        counts |= Counter(tuple(data.items()) for data in result.warnings)  # the larger count
    for raised, count in counts.items():
        data = dict(raised)
        category = _warning_category(data["category"])
        for _ in range(count):
            message = category(data["message"])
            _record(
                item,
                warnings.WarningMessage(message, category, data["filename"], data["lineno"]),
            )


def _warning_category(name: str) -> type[Warning]:
    module_name, _, qualname = name.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except Exception:
        return UserWarning
    return target if isinstance(target, type) and issubclass(target, Warning) else UserWarning


def _record(item: pytest.Item, message: warnings.WarningMessage) -> None:
    item.ihook.pytest_warning_recorded.call_historic(
        kwargs=dict(warning_message=message, when="runtest", nodeid=item.nodeid, location=None)
    )
