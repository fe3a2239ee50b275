"""Test durations of the last run, kept in the pytest cache to order work longest-first."""

from __future__ import annotations

import pytest

CACHE_KEY = "xdist_megatron/durations"


class DurationRecorder:
    """Adds up setup, call and teardown time per test and saves it at the end of the session."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.measured: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self) -> None:
        cache = getattr(self.config, "cache", None)
        if cache is None or not self.measured:
            return
        cache.set(CACHE_KEY, {**load(self.config), **self.measured})


def load(config: pytest.Config) -> dict[str, float]:
    cache = getattr(config, "cache", None)
    if cache is None:
        return {}
    value = cache.get(CACHE_KEY, {})
    return value if isinstance(value, dict) else {}
