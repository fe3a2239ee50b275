"""Test durations, to order the scheduler's work longest-first and to balance the shards.

The pytest cache keeps the last run's (the default). A CI job starts from a clean checkout with
no cache, so a durations file can stand in for it: read with `--megatron-durations PATH`, and
written (merged: this run's tests replace their entries, the others stay) with
`--megatron-store-durations`, as pytest-split's `--durations-path` / `--store-durations`.

Only a run that used the plugin writes, and with its durations the record of the modules that
had tests on gangs, from which the next run decides to start early (`early_cache`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..protocol import module_of, write_json
from ..roles import Role, role_of
from . import early_cache

CACHE_KEY = "xdist_megatron/durations"
SIZES_KEY = "xdist_megatron/world_sizes"  # the last run's (unmarked: 1), for -n auto
FILE_VERSION = 1
WORLD_SIZE_PROPERTY = "world_size"  # the user property a test's report carries its size in


def add_options(group: Any, parser: pytest.Parser) -> None:
    group.addoption(
        "--megatron-durations",
        default=None,
        metavar="PATH",
        help="a JSON file of test durations to order the work and balance --megatron-shard "
        "(default: ini megatron_durations; unset: the last run's, in the pytest cache).",
    )
    group.addoption(
        "--megatron-store-durations",
        action="store_true",
        help="merge this run's test durations into the --megatron-durations file at the end.",
    )
    parser.addini("megatron_durations", "default of --megatron-durations", default="")


@dataclass(frozen=True)
class Timing:
    """One test's entry in a durations file."""

    world_size: int | None  # None: the test ran in the driver
    duration: float  # seconds: setup, call and teardown


def file_path(config: pytest.Config) -> Path | None:
    """The durations file: the option's path (from the invocation folder), else the ini's (from
    the ini file's folder); None when neither is set."""
    given = config.getoption("megatron_durations")
    if given:
        return config.invocation_params.dir / given
    configured = config.getini("megatron_durations")
    if configured:
        base = config.inipath.parent if config.inipath else config.rootpath
        return base / configured
    return None


def check(config: pytest.Config) -> None:
    """At configure time: storing needs a file, and a file that exists must be readable."""
    path = file_path(config)
    if path is None:
        if config.getoption("megatron_store_durations"):
            raise pytest.UsageError("--megatron-store-durations needs --megatron-durations PATH")
        return
    try:
        read_file(path)
    except (OSError, ValueError) as exc:
        raise pytest.UsageError(f"--megatron-durations {path}: {exc}") from None


def read_file(path: Path) -> dict[str, Timing]:
    """A durations file's entries; none when it does not exist yet (a CI's first run)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        data = {}
    tests = data.get("tests")
    if data.get("version") != FILE_VERSION or not isinstance(tests, dict):
        raise ValueError(f'expected {{"version": {FILE_VERSION}, "tests": {{nodeid: ...}}}}')
    return {
        nodeid: Timing(entry.get("world_size"), float(entry["duration"]))
        for nodeid, entry in tests.items()
    }


def write_file(path: Path, timings: dict[str, Timing]) -> None:
    """Write the durations file, sorted by node id, atomically (another CI job may read it)."""
    tests = {
        n: {"world_size": t.world_size, "duration": round(t.duration, 4)}
        for n, t in timings.items()
    }
    data = {"version": FILE_VERSION, "tests": dict(sorted(tests.items()))}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data, indent=1)


def load(config: pytest.Config) -> dict[str, float]:
    """Seconds per node id: the durations file's, else the pytest cache's."""
    path = file_path(config)
    if path is not None:
        return {nodeid: timing.duration for nodeid, timing in read_file(path).items()}
    return _cached(config)


def _cached(config: pytest.Config) -> dict[str, float]:
    """Seconds per node id in the pytest cache (none without a cache)."""
    cache = getattr(config, "cache", None)
    value = cache.get(CACHE_KEY, {}) if cache is not None else {}
    return value if isinstance(value, dict) else {}


def cached_world_sizes(config: pytest.Config) -> set[int]:
    """The world sizes of the last run's tests, read before the cache plugin has configured
    itself (`-n auto` is decided that early); none when what is there is not a list of sizes."""
    sizes = early_cache.value(config, SIZES_KEY)
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s > 0 for s in sizes):
        return set()
    return set(sizes)


class DurationRecorder:
    """Adds up setup, call and teardown time per test and, in a run that used the plugin, saves
    it at the end of the session: in the pytest cache, and in the durations file when asked to.
    A run used it where `engaged()` says so, or where a test ran on a gang (an xdist controller
    learns that from its workers' reports alone)."""

    def __init__(self, config: pytest.Config, engaged: Callable[[], bool]) -> None:
        self.config = config
        self.engaged = engaged
        self.measured: dict[str, float] = {}
        self.sizes: dict[str, int | None] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + report.duration
        for name, value in report.user_properties:
            if name == WORLD_SIZE_PROPERTY:
                self.sizes[report.nodeid] = value

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self) -> None:
        if not self.measured or not (self.sizes or self.engaged()):
            return
        cache = getattr(self.config, "cache", None)
        if cache is not None:
            cache.set(CACHE_KEY, {**_cached(self.config), **self.measured})
            cache.set(SIZES_KEY, sorted({self.sizes.get(n) or 1 for n in self.measured}))
            # torchrun's ranks run no gang: they say nothing of the modules
            if role_of(self.config) is not Role.TORCHRUN_RANK:
                self._record_gang_modules(cache)
        path = file_path(self.config)
        if path is not None and self.config.getoption("megatron_store_durations"):
            timings = {n: Timing(self.sizes.get(n), d) for n, d in self.measured.items()}
            write_file(path, {**read_file(path), **timings})

    def _record_gang_modules(self, cache: pytest.Cache) -> None:
        """The modules of this run's tests on gangs replace what the record said of the
        modules this run ran; the others' entries stay."""
        known = early_cache.gang_modules(self.config)
        ran = {module_of(nodeid) for nodeid in self.measured}
        on_gangs = {module_of(nodeid) for nodeid, size in self.sizes.items() if size}
        record = sorted({*(m for m in known if m not in ran), *on_gangs})
        if record != known:
            cache.set(early_cache.GANG_MODULES_KEY, record)
