"""Split a suite into N parts of about equal device-time for N CI jobs: pure, no pytest import.

A part is a set of (module, world size) units, never a split unit: the tests of one unit share a
gang and their module's fixtures, so splitting them would start that gang (and fixtures) twice.
Units go longest first onto the least-loaded part (ties: the lower part, names in order), so the
same tests and durations always give the same parts, on every xdist worker and every CI job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_DURATION = 1.0  # seconds, for a test when no duration at all is known


@dataclass(frozen=True)
class ShardEntry:
    """One collected test as the partition sees it."""

    nodeid: str
    module: str
    world_size: int | None  # None: an unmarked test, run on one device in the driver
    duration: float

    @property
    def device_time(self) -> float:
        """Device-seconds the test holds: every device of its gang for its whole duration."""
        return (self.world_size or 1) * self.duration


def parse_shard(text: str) -> tuple[int, int]:
    """`K/N` -> (K, N), part K (1-based) of N; ValueError when malformed."""
    part, sep, count = text.partition("/")
    try:
        k, n = int(part), int(count)
    except ValueError:
        k = n = 0
    if not sep or n < 1 or not 1 <= k <= n:
        raise ValueError(f"expected K/N with 1 <= K <= N, got {text!r}")
    return k, n


def typical_duration(known: Iterable[float]) -> float:
    """What an unknown test is assumed to take: the median of the known ones, else 1 s."""
    values = sorted(known)
    return values[len(values) // 2] if values else DEFAULT_DURATION


def partition(entries: Sequence[ShardEntry], parts: int) -> list[list[str]]:
    """The node ids of each of `parts` parts, in the order of `entries`; disjoint, and together
    every entry."""
    units: dict[tuple[str, int], float] = {}
    for entry in entries:
        key = _unit(entry)
        units[key] = units.get(key, 0.0) + entry.device_time
    loads = [0.0] * parts
    part_of: dict[tuple[str, int], int] = {}
    for key in sorted(units, key=lambda k: (-units[k], k)):
        lightest = min(range(parts), key=lambda p: (loads[p], p))
        part_of[key] = lightest
        loads[lightest] += units[key]
    chosen: list[list[str]] = [[] for _ in range(parts)]
    for entry in entries:
        chosen[part_of[_unit(entry)]].append(entry.nodeid)
    return chosen


def _unit(entry: ShardEntry) -> tuple[str, int]:
    return entry.module, entry.world_size or 0
