"""How far to split a (module, world size) unit: pure arithmetic on estimated durations.

The scheduler keeps a unit's tests together (one gang start, one collection of the module) and
splits only where the numbers here say the split ends sooner despite the second start. No
imports beyond the standard library: the scheduler and its tests use these with plain floats.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_point(
    victim: float, thief: float, tail: Sequence[float], cost: float
) -> tuple[int, float]:
    """How many of the last tests of `tail` to move from a worker with `victim` seconds of work
    left to one with `thief` seconds (paying `cost` once for any), and when the later of the two
    then finishes: the count that finishes soonest, 0 when moving none is as soon."""
    best_count, best_finish = 0, max(victim, thief)
    moved = 0.0
    for count, duration in enumerate(reversed(tail), start=1):
        moved += duration
        finish = max(victim - moved, thief + cost + moved)
        if finish < best_finish:
            best_count, best_finish = count, finish
    return best_count, best_finish


def split_evenly(durations: Sequence[float], most: int, cost: float) -> list[int]:
    """How many of `durations`, in order, each of at most `most` parts takes: the number of parts
    whose longest part, plus `cost` when there is more than one, is the shortest."""
    best = [len(durations)]
    best_end = sum(durations)
    for parts in range(2, min(most, len(durations)) + 1):
        sizes = _balanced(durations, parts)
        start, longest = 0, 0.0
        for size in sizes:
            longest = max(longest, sum(durations[start : start + size]))
            start += size
        if longest + cost < best_end:
            best, best_end = sizes, longest + cost
    return best


def _balanced(durations: Sequence[float], parts: int) -> list[int]:
    """Cut `durations` in order into `parts` runs of about equal sums (none empty)."""
    target = sum(durations) / parts
    sizes: list[int] = []
    run, total = 0, 0.0
    for position, duration in enumerate(durations):
        opening = parts - len(sizes) - 1  # parts still to open after the current one
        left = len(durations) - position  # this one included
        if run and opening and (total + duration / 2 > target or left <= opening):
            sizes.append(run)
            run, total = 0, 0.0
        run += 1
        total += duration
    sizes.append(run)
    return sizes
