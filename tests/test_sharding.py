"""The pure partition behind --megatron-shard: parts are disjoint, cover the suite, keep units
whole, do not depend on the input's order, and balance device-time."""

from __future__ import annotations

import random

import pytest

from xdist_megatron.ci.sharding import (
    ShardEntry,
    parse_shard,
    partition,
    typical_duration,
)

SIZES = (1, 2, 4, 8)


def generated_suite(tests: int = 200, modules: int = 20, seed: int = 11) -> list[ShardEntry]:
    """`tests` tests over `modules` modules, world sizes 1/2/4/8 mixed within each module (and
    some unmarked), durations 0.1-5 s."""
    rng = random.Random(seed)
    entries = []
    for index in range(tests):
        module = f"tests/test_m{index % modules:02d}.py"
        size = None if index % 13 == 0 else SIZES[(index // modules + index) % len(SIZES)]
        duration = round(rng.uniform(0.1, 5.0), 2)
        entries.append(ShardEntry(f"{module}::test_{index:03d}", module, size, duration))
    return entries


def unit(entry: ShardEntry) -> tuple[str, int | None]:
    return entry.module, entry.world_size


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_parts_are_disjoint_and_cover_the_suite(parts: int) -> None:
    entries = generated_suite()
    chosen = partition(entries, parts)
    assert len(chosen) == parts
    flat = [nodeid for part in chosen for nodeid in part]
    assert sorted(flat) == sorted(e.nodeid for e in entries)
    assert len(set(flat)) == len(flat)


def test_a_module_and_world_size_unit_stays_in_one_part() -> None:
    entries = generated_suite()
    part_of = {nodeid: p for p, part in enumerate(partition(entries, 4)) for nodeid in part}
    parts_of_unit: dict[tuple, set[int]] = {}
    for entry in entries:
        parts_of_unit.setdefault(unit(entry), set()).add(part_of[entry.nodeid])
    assert all(len(parts) == 1 for parts in parts_of_unit.values())
    assert len(parts_of_unit) > 40  # the suite has many units: the balance below means something


def test_the_partition_does_not_depend_on_the_collection_order() -> None:
    entries = generated_suite()
    shuffled = list(entries)
    random.Random(3).shuffle(shuffled)
    assert [set(p) for p in partition(entries, 4)] == [set(p) for p in partition(shuffled, 4)]


def test_each_part_keeps_the_collection_order() -> None:
    entries = generated_suite()
    order = {e.nodeid: i for i, e in enumerate(entries)}
    for part in partition(entries, 3):
        assert part == sorted(part, key=order.__getitem__)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_device_time_is_balanced_within_15_percent(parts: int) -> None:
    entries = generated_suite()
    loads = device_times(entries, partition(entries, parts))
    print(f"{parts} parts: device-seconds {[round(x, 1) for x in loads]}")
    assert max(loads) / min(loads) <= 1.15


def test_device_time_counts_every_device_of_the_gang() -> None:
    big = ShardEntry("m.py::big", "m.py", 8, 1.0)  # 8 device-seconds
    small = [ShardEntry(f"n{i}.py::t", f"n{i}.py", None, 1.0) for i in range(8)]
    parts = partition([big, *small], 2)
    assert parts[0] == ["m.py::big"]
    assert device_times([big, *small], parts) == [8.0, 8.0]


def test_more_parts_than_units_leaves_some_parts_empty() -> None:
    entries = [ShardEntry("m.py::a", "m.py", 2, 1.0), ShardEntry("m.py::b", "m.py", 2, 3.0)]
    assert partition(entries, 3) == [["m.py::a", "m.py::b"], [], []]


@pytest.mark.parametrize("text, expected", [("1/1", (1, 1)), ("2/4", (2, 4)), ("4/4", (4, 4))])
def test_parse_shard(text: str, expected: tuple[int, int]) -> None:
    assert parse_shard(text) == expected


@pytest.mark.parametrize("text", ["0/4", "5/4", "1/0", "2", "a/b", "1/2/3", ""])
def test_parse_shard_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="K/N"):
        parse_shard(text)


def test_unknown_tests_take_the_median_of_the_known() -> None:
    assert typical_duration([3.0, 1.0, 2.0]) == 2.0
    assert typical_duration([]) == 1.0


def device_times(entries: list[ShardEntry], parts: list[list[str]]) -> list[float]:
    """Each part's device-seconds."""
    cost = {entry.nodeid: entry.device_time for entry in entries}
    return [sum(cost[nodeid] for nodeid in part) for part in parts]
