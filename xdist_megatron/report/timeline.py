"""A run's timeline: where and when each test ran, and when gangs started and retired, with the
summary the terminal shows. Pure data and arithmetic: no pytest, no torch.

Drivers record the facts (driver/run_facts.py), reports carry them to the controller, which
gathers them (run_report) and draws them (gantt).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

from .. import placement
from ..protocol import GangEvent, module_of

TIMELINE_VERSION = 1
GAP_SHOWN = 3  # the longest idle gaps the terminal names
GAP_COUNTED = 0.1  # seconds: shorter gaps are the plugin's own between tests, not idle devices
UNITS_SHOWN = 3


@dataclass(frozen=True)
class Span:
    """One test: where and when it ran (from the start of its protocol to its last report)."""

    nodeid: str
    start: float
    end: float
    world_size: int | None  # None: it ran in the driver, on the worker's home device
    devices: tuple[int, ...]
    worker: str
    gang: str | None
    outcome: str
    gpu_used: tuple[int, ...] = ()  # bytes in use on each of `devices` as the test ended

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


def document(spans: list[Span], events: list[GangEvent], devices: tuple[int, ...]) -> dict:
    """The timeline as the JSON file holds it."""
    return {
        "version": TIMELINE_VERSION,
        "devices": list(devices),
        "tests": [asdict(span) for span in spans],
        "gang_events": [asdict(event) for event in events],
    }


def makespan(spans: list[Span]) -> tuple[float, float]:
    return min(s.start for s in spans), max(s.end for s in spans)


def utilisation(spans: list[Span], device_count: int) -> float:
    """Busy device-seconds over device-seconds available in the test phase, on `device_count`
    devices (those the run's gangs could hold: `reachable`)."""
    first, last = makespan(spans)
    busy = sum(len(s.devices) * s.seconds for s in spans)
    return busy / (device_count * (last - first)) if device_count and last > first else 0.0


def reachable(spans: list[Span], devices: tuple[int, ...], workers: int) -> tuple[int, ...]:
    """The devices the run could have used: each worker's block for each world size that ran
    (its home device for a test run in the driver), as placement gives them, and any device a
    test used. `workers`: the xdist workers (0: a serial run). Two workers of world size 2 on
    `cpu:8` reach 4 slots: the other 4 are never idle for want of work."""
    placed = placement.DeviceSet("cpu", devices, workers=workers)  # the kind places nothing
    sizes = {span.world_size for span in spans}
    held = {device for span in spans for device in span.devices}
    for worker in range(max(1, workers)):
        for size in sizes:
            held.update(placement.devices_of(placed, worker, size))
    return tuple(device for device in devices if device in held)


def idle_gaps(spans: list[Span], devices: tuple[int, ...]) -> list[tuple[float, int, float]]:
    """(seconds, device, start) of every idle stretch of a device in the test phase, longest
    first."""
    first, last = makespan(spans)
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for span in spans:
        for device in span.devices:
            busy[device].append((span.start, span.end))
    gaps = []
    for device in devices:
        free_from = first
        for start, end in sorted(busy[device]) + [(last, last)]:
            if start > free_from:
                gaps.append((start - free_from, device, free_from))
            free_from = max(free_from, end)
    return sorted(gaps, key=lambda g: (-g[0], g[1]))


def summary(
    spans: list[Span], events: list[GangEvent], devices: tuple[int, ...], workers: int = 0
) -> list[str]:
    """The terminal's lines: gangs, time per world size, utilisation, longest units, idle gaps;
    utilisation and the devices never used count only those the run could have used."""
    first, last = makespan(spans)
    lines = _gang_lines(events) + _size_lines(spans)
    usable = reachable(spans, devices, workers)
    line = (
        f"device utilisation: {utilisation(spans, len(usable)):.0%} of {len(usable)} devices "
        f"x {last - first:.1f} s (test phase"
    )
    out_of_reach = len(devices) - len(usable)
    reach = f"; {out_of_reach} of the {len(devices)} devices are out of the gangs' reach"
    lines.append(line + (reach if out_of_reach else "") + ")")
    units: dict[tuple[str, int | None], float] = defaultdict(float)
    for span in spans:
        units[module_of(span.nodeid), span.world_size] += span.seconds
    longest = sorted(units.items(), key=lambda u: -u[1])[:UNITS_SHOWN]
    lines.append("longest units: " + ", ".join(f"{m} {_ws(s)} {t:.1f} s" for (m, s), t in longest))
    return lines + _critical_lines(spans) + _sharing_lines(spans) + _idle_lines(spans, usable)


def _critical_lines(spans: list[Span]) -> list[str]:
    """The critical path: how much of the test phase it covers, and its longest tests."""
    path = critical_path(spans)
    first, last = makespan(spans)
    busy = sum(s.seconds for s in path)
    longest = sorted(path, key=lambda s: -s.seconds)[:UNITS_SHOWN]
    named = ", ".join(f"{s.nodeid} {s.seconds:.1f} s" for s in longest)
    return [
        f"critical path: {len(path)} tests, {busy:.1f} s of the {last - first:.1f} s test phase "
        f"(from {path[0].start - first:.1f} s in, on {path[-1].worker}); longest: {named}"
    ]


def critical_path(spans: list[Span]) -> list[Span]:
    """The tests that set the test phase's end, first to last: from the test that ended last,
    back through the test that held its worker or one of its devices until it could start (the
    latest to end at or before its start); where none did, it waited on nothing the run knows
    of (the worker's start, collection) and the path begins there."""
    if not spans:
        return []
    path = [max(spans, key=lambda s: s.end)]
    while True:
        test = path[-1]
        held = [
            s
            for s in spans
            if s.end <= test.start + GAP_COUNTED
            and s is not test
            and (s.worker == test.worker or set(s.devices) & set(test.devices))
            and s.start < test.start
        ]
        if not held:
            return path[::-1]
        path.append(max(held, key=lambda s: s.end))


def lanes(spans: list[Span]) -> dict[tuple[str, int], int]:
    """Which lane of each device every test used (`(nodeid, device)` to 0, 1...): the lowest
    lane free when it started, so a device has as many lanes as it had gangs at once."""
    by_device: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        for device in span.devices:
            by_device[device].append(span)
    lane_of: dict[tuple[str, int], int] = {}
    for device, group in by_device.items():
        ends: list[float] = []  # when each lane is free again
        for span in sorted(group, key=lambda s: (s.start, s.end)):
            lane = next((i for i, end in enumerate(ends) if end <= span.start), len(ends))
            ends[lane : lane + 1] = [span.end]
            lane_of[span.nodeid, device] = lane
    return lane_of


def gangs_at_once(spans: list[Span]) -> dict[int, int]:
    """The most tests that held each device at the same time."""
    return lane_counts(lanes(spans))


def lane_counts(lane_of: dict[tuple[str, int], int]) -> dict[int, int]:
    """How many lanes each device of `lanes` has."""
    most: dict[int, int] = defaultdict(int)
    for (_, device), lane in lane_of.items():
        most[device] = max(most[device], lane + 1)
    return dict(most)


def peak_gpu_used(spans: list[Span]) -> dict[int, int]:
    """The most bytes in use on each GPU at the end of a test, by every process on it."""
    peak: dict[int, int] = defaultdict(int)
    for span in spans:
        for device, used in zip(span.devices, span.gpu_used, strict=False):
            peak[device] = max(peak[device], used)
    return dict(peak)


def _sharing_lines(spans: list[Span]) -> list[str]:
    lines = []
    most = gangs_at_once(spans)
    if any(count > 1 for count in most.values()):
        shown = ", ".join(f"device {d}: {n}" for d, n in sorted(most.items()))
        lines.append(f"most tests at once on a device: {shown}")
    peak = peak_gpu_used(spans)
    if peak:
        shown = ", ".join(f"device {d} {b / 2**30:.1f} GiB" for d, b in sorted(peak.items()))
        lines.append(f"peak GPU memory in use, every process (at test ends): {shown}")
    return lines


def _idle_lines(spans: list[Span], devices: tuple[int, ...]) -> list[str]:
    used = {device for span in spans for device in span.devices}
    gaps = idle_gaps(spans, tuple(d for d in devices if d in used))
    gaps = [gap for gap in gaps if gap[0] >= GAP_COUNTED]
    first, _ = makespan(spans)
    shown = ", ".join(f"device {d} {t:.1f} s at +{s - first:.1f} s" for t, d, s in gaps[:GAP_SHOWN])
    total = sum(gap[0] for gap in gaps)
    lines = [f"idle gaps over {GAP_COUNTED} s: {len(gaps)}, {total:.1f} device-s"]
    lines[0] += f"; longest: {shown}" if gaps else ""
    unused = [str(d) for d in devices if d not in used]
    if unused:
        lines.append(f"devices never used: {', '.join(unused)}")
    return lines


def _gang_lines(events: list[GangEvent]) -> list[str]:
    causes: dict[tuple[int, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for event in events:
        causes[event.world_size, event.kind][event.cause] += 1
    lines = []
    for world_size in sorted({world_size for world_size, _ in causes}):
        parts = []
        for kind, word in (("start", "started"), ("retire", "retired")):
            counts = causes.get((world_size, kind))
            if counts:
                why = ", ".join(f"{n} {cause}" for cause, n in sorted(counts.items()))
                parts.append(f"{sum(counts.values())} {word} ({why})")
        lines.append(f"gangs of {world_size}: " + "; ".join(parts))
    return lines


def _size_lines(spans: list[Span]) -> list[str]:
    per_size: dict[int | None, list[Span]] = defaultdict(list)
    for span in spans:
        per_size[span.world_size].append(span)
    lines = []
    for world_size in sorted(per_size, key=lambda s: s or 0):
        group = per_size[world_size]
        seconds = sum(s.seconds for s in group)
        lines.append(f"{_ws(world_size)}: {len(group)} tests, {seconds:.1f} s")
    return lines


def _ws(world_size: int | None) -> str:
    return f"ws{world_size}" if world_size else "driver"
