"""What a driver tells about each test it ran, on the test's teardown report.

World world_size, devices and worker go into `user_properties`: junit writes them into the testcase,
and the durations file takes the world size from there. The test's span (start, end, gang) and
the gang starts and retirements it caused go into a report attribute: xdist serialises a
report's attributes, so the controller gets them with the report, and junit does not print them.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import pytest

from .. import placement
from ..ci.durations import WORLD_SIZE_PROPERTY
from ..protocol import GANGS_AT_CALL, HARNESS, SPAN_ATTRIBUTE, WORLD_SIZE

if TYPE_CHECKING:
    from .runtime import Runtime

SERIAL_WORKER = "main"  # the worker name of a run without xdist


class RunFacts:
    """pytest plugin of a driver: stamps each test's teardown report."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.worker: str = getattr(runtime.config, "workerinput", {}).get("workerid", SERIAL_WORKER)
        self._gangs_run = False  # whether the session has tests with a world size
        self._current: dict[str, Any] | None = None
        self._events_told = 0

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._gangs_run = session.config.stash.get(GANGS_AT_CALL, False) or any(
            WORLD_SIZE in item.stash for item in session.items
        )

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, Any, Any]:
        if self._gangs_run:
            self._current = {"nodeid": item.nodeid, "start": time.time(), "item": item}
        try:
            return (yield)
        finally:
            self._current = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        current = self._current
        if current is None or report.nodeid != current["nodeid"] or report.when != "teardown":
            return
        item = current["item"]
        world_size = item.stash.get(WORLD_SIZE, None)
        devices = placement.devices_of(self.runtime.devices, self.runtime.worker, world_size)
        facts = [("devices", ",".join(map(str, devices))), ("worker", self.worker)]
        if world_size is not None:  # an unmarked test ran in the driver: it has no world size
            facts.insert(0, (WORLD_SIZE_PROPERTY, world_size))
        # A new list: pytest shares the item's list with all its reports.
        report.user_properties = [*report.user_properties, *facts]
        gang = self._pool_facts(item, world_size)
        start, end = self._window(item, current["start"])
        span = {"start": start, "end": end, "world_size": world_size}
        span.update(devices=list(devices), worker=self.worker, **gang)
        if HARNESS in item.stash:
            span["harness"] = item.stash[HARNESS]
        setattr(report, SPAN_ATTRIBUTE, span)

    def _window(self, item: pytest.Item, start: float) -> tuple[float, float]:
        """When the test held its devices: for a test on a gang, its job's (not the wait for a
        device lock or the zygote); else its whole protocol."""
        hold = self.runtime.pool.last_hold if self.runtime.runs_on_ranks(item) else None
        if hold is not None and hold[0] >= start:
            return hold
        return start, time.time()

    def _pool_facts(self, item: pytest.Item, world_size: int | None) -> dict[str, Any]:
        """The gang the test ran on, and the gang events since the last test's report."""
        on_gang = (
            self.runtime.runs_on_ranks(item)
            or "gang" in getattr(item, "fixturenames", ())
            or HARNESS in item.stash
        )
        if world_size is None or not on_gang:
            return {"gang": None, "events": [], "gpu_used": []}
        pool = self.runtime.pool
        events = pool.log.events[self._events_told :]
        self._events_told = len(pool.log.events)
        named = [{**asdict(e), "gang": f"{self.worker}:{e.gang}"} for e in events]
        name = pool.log.names.get(world_size)
        gang = f"{self.worker}:{name}" if name else None
        return {"gang": gang, "events": named, "gpu_used": list(pool.last_gpu_used)}
