"""The run report: the timeline's arithmetic, the chart, and end to end the terminal section,
--megatron-report's JSON and SVG, and the junit properties, serially and under xdist."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from xdist_megatron.protocol import GangEvent
from xdist_megatron.report.gantt import svg
from xdist_megatron.report.timeline import (
    Span,
    critical_path,
    gangs_at_once,
    idle_gaps,
    lanes,
    peak_gpu_used,
    reachable,
    summary,
    utilisation,
)

CPU8 = ("--megatron-devices", "cpu:8")
SVG = "{http://www.w3.org/2000/svg}"

SUITE = """
import os
import pytest
import xdist_megatron

def test_unmarked():
    pass

@pytest.mark.world_size(2)
def test_pair(world_size):
    assert world_size == 2

@pytest.mark.world_size(2)
def test_rank_dies(rank):
    if rank == 1:
        os._exit(3)

@pytest.mark.world_size(2)
def test_after_the_death(rank):
    pass

@pytest.mark.world_size(4)
def test_four(rank):
    assert rank < 3

def exit_on_rank_one():
    if xdist_megatron.rank_info().rank == 1:
        os._exit(3)

@pytest.mark.world_size(3)
def test_gang_rank_dies(gang):
    gang.run(exit_on_rank_one)

@pytest.mark.world_size(3)
def test_gang_after_the_death(gang):
    gang.run(xdist_megatron.rank_info)
"""


def span(nodeid: str, start: float, end: float, devices: tuple[int, ...], size: int | None) -> Span:
    return Span(nodeid, start, end, size, devices, "gw0", None, "passed")


def test_utilisation_is_busy_device_seconds_over_devices_times_makespan() -> None:
    spans = [span("a.py::t", 0, 10, (0, 1), 2), span("b.py::t", 5, 10, (2,), None)]
    assert utilisation(spans, 4) == (20 + 5) / (4 * 10)


def test_idle_gaps_are_the_free_stretches_of_each_device_longest_first() -> None:
    spans = [span("a.py::t", 0, 2, (0,), 1), span("a.py::u", 5, 6, (0,), 1)]
    spans.append(span("b.py::t", 0, 10, (1,), 1))
    assert idle_gaps(spans, (0, 1)) == [(4.0, 0, 6.0), (3.0, 0, 2.0)]


def test_the_summary_counts_gangs_by_size_and_cause() -> None:
    spans = [span("a.py::t", 0, 2, (0, 1), 2), span("a.py::u", 2, 3, (0, 1), 2)]
    events = [
        GangEvent(0, "start", 2, "gw0:ws2#1", "first use"),
        GangEvent(2, "retire", 2, "gw0:ws2#1", "timeout"),
        GangEvent(2, "start", 2, "gw0:ws2#2", "replaced a retired one"),
    ]
    lines = summary(spans, events, (0, 1, 2, 3), workers=2)
    assert lines[0] == (
        "gangs of 2: 2 started (1 first use, 1 replaced a retired one); 1 retired (1 timeout)"
    )
    assert "ws2: 2 tests, 3.0 s" in lines
    assert "device utilisation: 50% of 4 devices x 3.0 s (test phase)" in lines
    assert "devices never used: 2, 3" in lines


def test_the_critical_path_follows_what_held_each_test_back() -> None:
    """From the test that ended last, back through what held its worker or a device it needed:
    gw1's gang of 2 waited for gw0's test on device 0, not for gw1's own short test."""
    a = Span("m.py::a", 0, 2, 1, (0,), "gw0", None, "passed")
    b = Span("m.py::b", 2, 5, 1, (0,), "gw0", None, "passed")
    c = Span("n.py::c", 0, 1, 1, (1,), "gw1", None, "passed")
    d = Span("n.py::d", 5, 9, 2, (0, 1), "gw1", None, "passed")
    assert critical_path([a, b, c, d]) == [a, b, d]
    assert (
        "critical path: 3 tests, 9.0 s of the 9.0 s test phase (from 0.0 s in, on gw1); "
        "longest: n.py::d 4.0 s, m.py::b 3.0 s, m.py::a 2.0 s"
    ) in summary([a, b, c, d], [], (0, 1), workers=2)


def test_utilisation_counts_the_devices_the_runs_gangs_reach() -> None:
    """Issue 44, 2g: two workers of world size 2 on cpu:8 hold slots 0-1 and 4-5, never the
    others: the report said '27% of 8 devices ... devices never used: 2, 3, 6, 7'. A worker
    that got no work leaves its block unused; a serial run reaches the first block only."""
    spans = [span("a.py::t", 0, 10, (0, 1), 2), span("b.py::t", 0, 5, (4, 5), 2)]
    assert reachable(spans, tuple(range(8)), workers=2) == (0, 1, 4, 5)
    lines = summary(spans, [], tuple(range(8)), workers=2)
    reach = "; 4 of the 8 devices are out of the gangs' reach"
    assert f"device utilisation: 75% of 4 devices x 10.0 s (test phase{reach})" in lines
    assert not [line for line in lines if line.startswith("devices never used")], lines
    assert "devices never used: 4, 5" in summary(spans[:1], [], tuple(range(8)), workers=2)
    assert reachable(spans[:1], tuple(range(8)), workers=0) == (0, 1)


TWO_MODULES_OF_PAIRS = """
import pytest

@pytest.mark.world_size(2)
@pytest.mark.parametrize("n", range(2))
def test_pair(n, rank):
    pass
"""


def test_utilisation_under_xdist_counts_what_its_workers_reach(run_pytest, pytester):
    """The issue's run: two workers, world size 2, the default of 8 CPU slots on a 2-core box."""
    pytester.makepyfile(test_one=TWO_MODULES_OF_PAIRS, test_two=TWO_MODULES_OF_PAIRS)
    result = run_pytest("-n", "2", "--dist", "megatron", *CPU8)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        ["device utilisation: *% of 4 devices x * s (test phase; 4 of the 8 devices are out *"]
    )
    for line in result.stdout.lines:
        if line.startswith("devices never used: "):
            assert set(line.split(": ")[1].split(", ")) <= {"0", "1", "4", "5"}, line


def test_the_chart_is_svg_with_a_bar_per_device_of_each_test() -> None:
    spans = [span("a.py::t<1>", 0, 2, (0, 1), 2), span("b.py::t", 1, 3, (2,), None)]
    root = ET.fromstring(svg(spans, (0, 1, 2, 3), "a run"))
    bars = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(bars) == 2  # one bar per block of adjacent devices
    assert bars[0].find(f"{SVG}title").text.startswith("a.py::t<1> (passed) 2.00 s")


def test_a_run_writes_the_timeline_the_chart_and_junit_properties(run_pytest, pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = run_pytest(
        *CPU8, "--megatron-report", "out/run.json", "--junitxml", "out/junit.xml"
    )  # fmt: skip
    result.assert_outcomes(passed=4, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*= xdist-megatron run report =*",
            "gangs of 2: 2 started (1 first use, 1 replaced a retired one); "
            "1 retired (1 a rank died)",
            "gangs of 3: 2 started (1 first use, 1 replaced a retired one); "
            "1 retired (1 a failure in a test)",
            "gangs of 4: 1 started (1 first use)",
            "device utilisation: *% of 4 devices x * s (test phase; 4 of the 8 devices are "
            "out of the gangs' reach)",
            "timeline: *run.json, chart: *run.svg",
        ]
    )
    timeline = json.loads((pytester.path / "out/run.json").read_text())
    tests = {t["nodeid"].split("::")[1]: t for t in timeline["tests"]}
    assert len(tests) == 7 and timeline["devices"] == list(range(8))
    assert (
        tests["test_four"]["devices"] == [0, 1, 2, 3] and tests["test_four"]["outcome"] == "failed"
    )
    assert tests["test_unmarked"]["world_size"] is None and tests["test_unmarked"]["gang"] is None
    assert tests["test_pair"]["gang"] == "main:ws2#1"
    assert tests["test_after_the_death"]["gang"] == "main:ws2#2"
    assert all(t["start"] <= t["end"] and t["worker"] == "main" for t in tests.values())
    ET.parse(pytester.path / "out/run.svg")
    cases = ET.parse(pytester.path / "out/junit.xml").getroot().iter("testcase")
    properties = {
        c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")} for c in cases
    }
    assert properties["test_pair"] == {"world_size": "2", "devices": "0,1", "worker": "main"}
    assert properties["test_unmarked"] == {"devices": "0", "worker": "main"}


def test_the_controller_reports_every_workers_tests(run_pytest, pytester):
    pytester.makepyfile(test_suite=SUITE)
    args = ("-n", "2", "--dist", "megatron", *CPU8, "--junitxml", "junit.xml")
    result = run_pytest(*args, "--megatron-report", "run.json")
    result.assert_outcomes(passed=4, failed=3)
    result.stdout.fnmatch_lines(["*= xdist-megatron run report =*", "gangs of 4: 1 started*"])
    tests = json.loads((pytester.path / "run.json").read_text())["tests"]
    assert len(tests) == 7 and {t["worker"] for t in tests} <= {"gw0", "gw1"}
    assert all(t["gang"].startswith(t["worker"]) for t in tests if t["world_size"])
    workers = [p.get("value") for p in ET.parse("junit.xml").getroot().iter("property")]
    assert {"gw0", "gw1"} & set(workers)


def test_no_section_without_gang_tests(run_pytest, pytester):
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = run_pytest("--megatron-report", "run.json")
    result.assert_outcomes(passed=1)
    assert "run report" not in result.stdout.str()
    assert not (pytester.path / "run.json").exists()


def shared(nodeid: str, start: float, end: float, devices: tuple[int, ...], used=()) -> Span:
    return Span(nodeid, start, end, len(devices), devices, "gw0", None, "passed", used)


def test_gangs_that_share_a_device_stack_in_lanes() -> None:
    """Three tests at once on device 0 (K = 3): three lanes there, the lowest free one reused;
    the chart stacks them in rows of their own; the summary names the most at once and the peak
    GPU memory in use per device."""
    spans = [
        shared("a", 0.0, 2.0, (0,), (1 << 30,)),
        shared("b", 0.5, 1.0, (0,), (3 << 30,)),
        shared("c", 0.6, 3.0, (0, 1), (2 << 30, 1 << 30)),
        shared("d", 1.5, 2.5, (0,)),
    ]
    lane_of = lanes(spans)
    assert [lane_of[n, 0] for n in "abcd"] == [0, 1, 2, 1]
    assert gangs_at_once(spans) == {0: 3, 1: 1}
    assert peak_gpu_used(spans) == {0: 3 << 30, 1: 1 << 30}
    lines = summary(spans, [], (0, 1))
    assert "most tests at once on a device: device 0: 3, device 1: 1" in lines
    assert any("peak GPU memory" in line and "device 0 3.0 GiB" in line for line in lines)
    labels = [t.text for t in ET.fromstring(svg(spans, (0, 1), "t")).iter(f"{SVG}text")]
    assert [label for label in labels if label.startswith("dev")] == [
        "dev 0.1", "dev 0.2", "dev 0.3", "device 1",
    ]  # fmt: skip
