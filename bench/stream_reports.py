"""One JSON line per test report, flushed as it happens, so that a run killed at its cap still
leaves the outcomes it reached (junit is written only at the end).

`real_suite.py` gives each torchrun rank a `StreamReports`; a run on the plugin takes it as
`-p stream_reports` with $STREAM_REPORTS naming the file. Only the process that reports the run
writes: not the plugin's ranks or zygote, not xdist's workers (their reports reach the
controller). With $COLLECTED_IDS naming a file, it also writes the collected node ids there."""

import json
import os

NOT_REPORTING = ("XDIST_MEGATRON_ZYGOTE", "PYTEST_XDIST_WORKER")


class StreamReports:
    """A pytest plugin object: one JSON line per report, flushed, so a killed run leaves them;
    with each phase's start and stop (epoch seconds), for where a torchrun run's wall went."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # open for the session

    def pytest_runtest_logreport(self, report) -> None:
        line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                "duration": report.duration, "xfail": hasattr(report, "wasxfail"),
                "start": getattr(report, "start", None),
                "stop": getattr(report, "stop", None)}  # fmt: skip
        self.file.write(json.dumps(line) + "\n")


class CollectedIds:
    """A pytest plugin object: the collected node ids, one per line. What `--collect-only`
    prints changes form with the verbosity a suite's addopts add (`-v` and `-q` meet)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def pytest_collection_finish(self, session) -> None:
        with open(self.path, "w") as file:
            file.writelines(f"{item.nodeid}\n" for item in session.items)


def pytest_configure(config) -> None:
    if any(name in os.environ for name in NOT_REPORTING):
        return
    if path := os.environ.get("STREAM_REPORTS"):
        config.pluginmanager.register(StreamReports(path), "stream-reports")
    if path := os.environ.get("COLLECTED_IDS"):
        config.pluginmanager.register(CollectedIds(path), "collected-ids")
