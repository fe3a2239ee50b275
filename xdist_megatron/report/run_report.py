"""The run report, in the process that sees every report (the serial driver, or the xdist
controller): a short terminal section and, with `--megatron-report PATH`, the timeline as JSON at
PATH and a Gantt chart of the devices beside it (PATH with the suffix `.svg`)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..protocol import SPAN_ATTRIBUTE, GangEvent
from . import gantt, timeline
from .timeline import Span

SECTION = "xdist-megatron run report"
OUTCOME_RANK = ("passed", "skipped", "failed")  # a test's outcome is its worst phase's


def add_options(group: Any) -> None:
    group.addoption(
        "--megatron-report",
        default=None,
        metavar="PATH",
        help="write the run's timeline (every test: start, end, devices, worker, gang, outcome) "
        "as JSON to PATH, and a Gantt chart of the devices to PATH with the suffix .svg.",
    )


class RunReport:
    """pytest plugin: gathers the spans the drivers stamped on the tests' reports."""

    def __init__(self, config: pytest.Config, devices: Callable[[], tuple[int, ...]]) -> None:
        self.config = config
        self.devices = devices  # asked only when a test ran on a gang: resolving may import torch
        self.outcomes: dict[str, str] = {}
        self.stamps: dict[str, dict] = {}
        self.written: Path | None = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        old = self.outcomes.get(report.nodeid, "passed")
        self.outcomes[report.nodeid] = max(old, report.outcome, key=OUTCOME_RANK.index)
        stamp = getattr(report, SPAN_ATTRIBUTE, None)
        if stamp is not None:
            self.stamps[report.nodeid] = stamp

    def spans(self) -> list[Span]:
        return [
            Span(
                nodeid,
                s["start"],
                s["end"],
                s["world_size"],
                tuple(s["devices"]),
                s["worker"],
                s["gang"],
                self.outcomes.get(nodeid, "passed"),
                tuple(s.get("gpu_used", ())),
            )  # fmt: skip
            for nodeid, s in self.stamps.items()
        ]

    def events(self) -> list[GangEvent]:
        found = [GangEvent(**e) for s in self.stamps.values() for e in s["events"]]
        return sorted(found, key=lambda e: e.time)

    def pytest_sessionfinish(self) -> None:
        path = self.config.getoption("megatron_report")
        spans = self.spans()
        if path is None or not spans:
            return
        target = self.config.invocation_params.dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        devices = self.devices()
        document = timeline.document(spans, self.events(), devices)
        target.write_text(json.dumps(document, indent=1) + "\n")
        title = f"{len(spans)} tests on {len(devices)} devices"
        target.with_suffix(".svg").write_text(gantt.svg(spans, devices, title))
        self.written = target

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        spans = self.spans()
        if not any(span.world_size for span in spans):
            return  # no gang ran: nothing to say about devices
        terminalreporter.section(SECTION)
        workers = len(self.config.getoption("tx", None) or ())  # xdist's; none: serial
        for line in timeline.summary(spans, self.events(), self.devices(), workers):
            terminalreporter.line(line)
        harnesses = Counter(s["harness"] for s in self.stamps.values() if s.get("harness"))
        if harnesses:
            counts = ", ".join(f"{name} {n} tests" for name, n in sorted(harnesses.items()))
            terminalreporter.line(f"spawn harnesses on gangs: {counts}")
        if self.written is not None:
            svg = self.written.with_suffix(".svg")
            terminalreporter.line(f"timeline: {self.written}, chart: {svg}")
