"""`-p stream_reports` (glue, not upstream): one JSON line per test report to $MODELOPT_STREAM, as
bench/real_suite.py's StreamReports writes them, so that a run killed at its cap still leaves
the outcomes of the tests it finished (junit is written only at the end). Only the process that
reports the run writes: not the plugin's ranks or zygote, not xdist's workers (their reports
reach the controller)."""

import json
import os

NOT_REPORTING = ("XDIST_MEGATRON_ZYGOTE", "PYTEST_XDIST_WORKER")


class StreamReports:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # open for the session

    def pytest_runtest_logreport(self, report) -> None:
        line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                "duration": report.duration, "xfail": hasattr(report, "wasxfail")}  # fmt: skip
        self.file.write(json.dumps(line) + "\n")


def pytest_configure(config) -> None:
    path = os.environ.get("MODELOPT_STREAM")
    if path and not any(name in os.environ for name in NOT_REPORTING):
        config.pluginmanager.register(StreamReports(path), "modelopt-stream-reports")
