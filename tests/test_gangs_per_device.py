"""`--megatron-gangs-per-device K` and `@pytest.mark.exclusive_devices`, end to end: two pytest
sessions pointed at one lock folder, on the same CPU slots. Each test records on rank 0 when its
body ran; from those windows: with K = 2 the sessions' gangs meet on the devices (each test waits
for the other session's), no device ever holds more than K gangs, and an exclusive test runs
alone; with K = 1 they never overlap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_no_processes_left

SUITE = """
import json, os, time
import pytest

RECORD = os.environ["WINDOWS_DIR"]
SESSION = os.environ["SESSION_NAME"]
OTHER = "b" if SESSION == "a" else "a"
MEET = float(os.environ["MEET_SECONDS"])


def record(name, start, rank):
    if rank == 0:
        with open(os.path.join(RECORD, f"{SESSION}-{name}.json"), "w") as f:
            json.dump({"start": start, "end": time.time(), "exclusive": name == "alone"}, f)


@pytest.mark.world_size(2)
def test_meet(rank):
    start = time.time()
    if rank == 0:
        open(os.path.join(RECORD, f"{SESSION}.here"), "w").close()
    other = os.path.join(RECORD, f"{OTHER}.here")
    deadline = time.monotonic() + MEET
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.05)
    met = os.path.exists(other)
    time.sleep(0.3)  # the other session's rank 0 may look a moment later
    record("meet", start, rank)
    print("met" if met else "did not meet")


@pytest.mark.world_size(2)
@pytest.mark.exclusive_devices
def test_alone(rank):
    start = time.time()
    time.sleep(0.5)
    record("alone", start, rank)


@pytest.mark.world_size(2)
def test_after(rank):
    start = time.time()
    time.sleep(0.3)
    record("after", start, rank)
"""


def run_sessions(pytester: pytest.Pytester, per_device: int, meet: float) -> list[str]:
    """Both sessions at once; their outputs."""
    records = pytester.path / "windows"
    records.mkdir()
    locks = pytester.path / "locks"
    processes = []
    for name in ("a", "b"):
        env = {**os.environ, "WINDOWS_DIR": str(records), "SESSION_NAME": name}
        env["MEET_SECONDS"] = str(meet)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "-q"]
        command += ["--megatron-devices", "cpu:2", "--megatron-lock-dir", str(locks)]
        command += ["--megatron-gangs-per-device", str(per_device), "--megatron-timeout", "90"]
        processes.append(
            subprocess.Popen(command, cwd=pytester.path, env=env, stdout=subprocess.PIPE, text=True)
        )
    return [process.communicate(timeout=240)[0] for process in processes]


def windows(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def most_at_once(spans: list[dict]) -> int:
    edges = sorted([(s["start"], 1) for s in spans] + [(s["end"], -1) for s in spans])
    count = peak = 0
    for _, step in edges:
        count += step
        peak = max(peak, count)
    return peak


def overlaps(one: dict, other: dict) -> bool:
    return one["start"] < other["end"] and other["start"] < one["end"]


def test_two_gangs_share_the_devices_and_an_exclusive_test_runs_alone(pytester, tag) -> None:
    pytester.makepyfile(test_shared=SUITE)
    outputs = run_sessions(pytester, per_device=2, meet=60)
    assert_no_processes_left(tag)
    for output in outputs:
        assert "3 passed" in output, output
        assert "met" in output.split() and "did not meet" not in output, output
    spans = windows(pytester.path / "windows")
    assert len(spans) == 6
    assert most_at_once(spans) <= 2
    for alone in (s for s in spans if s["exclusive"]):
        assert not [s for s in spans if s is not alone and overlaps(alone, s)]


def test_one_gang_per_device_by_default(pytester, tag) -> None:
    pytester.makepyfile(test_shared=SUITE)
    started = time.monotonic()
    outputs = run_sessions(pytester, per_device=1, meet=1.5)
    assert_no_processes_left(tag)
    for output in outputs:
        assert "3 passed" in output, output
    assert [o.split().count("met") for o in outputs].count(1) <= 1  # only the later one meets
    spans = windows(pytester.path / "windows")
    assert most_at_once(spans) == 1, (spans, time.monotonic() - started)


@pytest.mark.parametrize("per_device", [1, 3])
def test_n_auto_starts_a_worker_per_gang_the_devices_hold(pytester, run_pytest, per_device) -> None:
    """DESIGN: with K gangs per device, `-n auto` is devices x K workers."""
    pytester.makepyfile(
        test_one="import pytest\n\n@pytest.mark.world_size(1)\ndef test_a():\n    pass\n"
    )
    result = run_pytest(
        *("-n", "auto", "--dist", "megatron", "--megatron-devices", "cpu:2"),
        *("--megatron-gangs-per-device", str(per_device)),
    )
    result.stdout.fnmatch_lines([f"{2 * per_device} workers [[]1 item[]]"])
    result.assert_outcomes(passed=1)


def test_a_bad_count_is_a_usage_error(pytester) -> None:
    pytester.makepyfile(test_shared="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--megatron-gangs-per-device", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--megatron-gangs-per-device*positive int, got '0'*"])


XDIST_SUITE = """
import json, os, time
import pytest

RECORD = os.environ["WINDOWS_DIR"]


def record(name, start, rank, exclusive=False):
    if rank == 0:
        with open(os.path.join(RECORD, f"{name}.json"), "w") as f:
            json.dump({"start": start, "end": time.time(), "exclusive": exclusive}, f)


def meet(name, other, rank):
    start = time.time()
    if rank == 0:
        open(os.path.join(RECORD, f"{name}.here"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(RECORD, f"{other}.here")):
        assert time.monotonic() < deadline, f"{other} never ran beside {name}"
        time.sleep(0.05)
    time.sleep(0.3)
    record(name, start, rank)
"""


def meeting_module(me: str, other: str) -> str:
    """A module whose first test waits for module `other`'s to run beside it, then a short one."""
    return (
        XDIST_SUITE
        + f"""
@pytest.mark.world_size(2)
def test_meet_{other}(rank):
    meet("{me}", "{other}", rank)


@pytest.mark.world_size(2)
def test_short_{me}(rank):
    record("short-{me}", time.time(), rank)
"""
    )


XDIST_MODULES = {
    "test_a": meeting_module("a", "b"),
    "test_b": meeting_module("b", "a"),
    "test_c": XDIST_SUITE
    + """
@pytest.mark.world_size(2)
@pytest.mark.exclusive_devices
def test_alone(rank):
    start = time.time()
    time.sleep(0.5)
    record("alone", start, rank, exclusive=True)
""",
}


def test_the_scheduler_places_k_gangs_on_a_device(pytester, run_pytest, monkeypatch) -> None:
    """`-n 2 --dist megatron` on cpu:2 with K = 2: the two modules' gangs, each needing both slots,
    run at once (each test waits for the other's), never more than two at a time, and the
    exclusive test runs alone; the run report stacks the two gangs on each device."""
    pytester.makepyfile(**XDIST_MODULES)
    records = pytester.path / "windows"
    records.mkdir()
    monkeypatch.setenv("WINDOWS_DIR", str(records))
    result = run_pytest(
        *("-n", "2", "--dist", "megatron", "--megatron-devices", "cpu:2"),
        *("--megatron-gangs-per-device", "2", "--megatron-timeout", "120"),
        *("--megatron-report", "report.json"),
    )
    result.stdout.fnmatch_lines(["most tests at once on a device: device 0: 2, device 1: 2"])
    assert "dev 0.2" in (pytester.path / "report.svg").read_text()
    result.assert_outcomes(passed=5)
    spans = windows(records)
    assert len(spans) == 5
    assert most_at_once(spans) == 2
    alone = next(s for s in spans if s["exclusive"])
    assert not [s for s in spans if s is not alone and overlaps(alone, s)]
