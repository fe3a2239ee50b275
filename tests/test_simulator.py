"""The clocked simulation of `--dist megatron` (bench/_simulator.py), and the scheduler through it.

The simulator drives the real MegatronScheduling through fake xdist workers, so these tests pin
what the scheduler achieves on lanes of issue 21's shape (makespan against the ideal bound), when
it splits a unit and when it keeps one whole, and the xdist and driver behaviour the simulation
relies on (held-back tests, device locks, steals answered all-or-nothing).
"""

from __future__ import annotations

import statistics

import pytest
from _simulator import (
    Costs,
    SimTest,
    SimulationError,
    cpu_devices,
    ideal_bound,
    random_lane,
    simulate,
)

from xdist_megatron.controller.splitting import split_evenly, split_point

LANES = range(100)  # fixed seeds: the same 100 lanes every run
FREE = Costs(gang_start=0.0, module=0.0)


def lane_of(module: str, world_size: int | None, durations: list[float]) -> list[SimTest]:
    return [
        SimTest(f"{module}::t{i}", module, world_size, duration)
        for i, duration in enumerate(durations)
    ]


@pytest.mark.parametrize("known", [True, False], ids=["durations known", "first run"])
def test_random_lanes_stay_close_to_the_ideal_bound(known: bool) -> None:
    """60 tests in 10 modules, world sizes 1/2/4/8 drawn 4:3:2:1, 0.2-1.5 s each, on 8 devices and
    8 workers: the median makespan within 1.1x the ideal bound and none over 1.3x, whether the
    scheduler knows the durations or (a first run) assumes 1 s for each."""
    ratios = [
        simulate(random_lane(seed), 8, 8, known=None if known else {}).ratio for seed in LANES
    ]
    assert statistics.median(ratios) <= 1.1, sorted(ratios)[50]
    assert max(ratios) <= 1.3, max(ratios)


def test_ideal_bound() -> None:
    """One gang start and module, then the larger of device-seconds over the devices and the
    longest test; unmarked tests alone pay no gang start."""
    costs = Costs(gang_start=0.1, module=0.05)
    lane = lane_of("a.py", 8, [2.0]) + lane_of("b.py", 1, [1.0] * 8)
    assert ideal_bound(lane, 8, costs) == pytest.approx(0.15 + (16 + 8) / 8)
    assert ideal_bound(lane_of("a.py", 2, [5.0, 0.5]), 8, costs) == pytest.approx(5.15)
    assert ideal_bound(lane_of("a.py", None, [1.0, 1.0]), 2, costs) == pytest.approx(1.0)


def test_a_held_back_test_waits_for_shutdown() -> None:
    """A worker runs its last test only once another test or shutdown arrives: with one test on
    one worker that is the scheduler's shutdown once nothing is left to queue or steal."""
    result = simulate(lane_of("a.py", 1, [1.0]), 1, 1, Costs(0.1, 0.05))
    assert result.makespan == pytest.approx(1.15)
    assert [span.worker for span in result.spans] == [0]


def test_device_locks_serialise_gangs_on_shared_devices() -> None:
    """Every span holds its block; no two spans share a device at once, whatever the scheduler."""
    result = simulate(random_lane(3), 8, 8)
    for first in result.spans:
        for second in result.spans:
            if first is not second and set(first.devices) & set(second.devices):
                assert first.end <= second.start or second.end <= first.start


def test_a_unit_splits_over_blocks_that_sit_idle() -> None:
    """One module of 16 ws1 tests and 4 workers: the other three would idle, so the unit goes out
    in four parts at once, each paying its own gang start and module."""
    lane = lane_of("a.py", 1, [1.0] * 16)
    result = simulate(lane, 4, 4, Costs(0.1, 0.05))
    assert {span.worker for span in result.spans} == {0, 1, 2, 3}
    assert result.gang_starts == 4 and result.module_loads == 4
    assert result.makespan == pytest.approx(4.15)


def test_units_stay_whole_when_each_block_has_one() -> None:
    """Eight modules of four ws1 tests on eight workers: a unit per worker, so no unit is split
    (one gang and one module collection each) and the makespan is the ideal."""
    lane = [t for m in range(8) for t in lane_of(f"m{m}.py", 1, [0.5] * 4)]
    result = simulate(lane, 8, 8, Costs(0.1, 0.05))
    assert result.gang_starts == 8 and result.module_loads == 8 and result.steals == 0
    assert result.ratio == pytest.approx(1.0)


def test_the_tail_is_stolen() -> None:
    """Two workers on two devices, a unit of six tests and one of a single test: the worker with
    the single test takes the end of the other's queue (a steal), as worksteal does."""
    lane = lane_of("a.py", 1, [1.0] * 6) + lane_of("b.py", 1, [1.0])
    result = simulate(lane, 2, 2, Costs(0.1, 0.05))
    assert result.steals == 1
    assert result.makespan == pytest.approx(4.15)
    assert simulate(lane, 2, 2, Costs(0.1, 0.05), known={}).steals == 1  # durations unknown


def test_a_steal_answered_with_nothing_is_retried_on_the_facts() -> None:
    """With messages in flight for a while, a worker may have begun the tests asked of it; it
    answers with none, the scheduler tries again on what it has heard since, and nothing is lost
    or run twice."""
    lane = lane_of("a.py", 1, [0.3] * 9) + lane_of("b.py", 1, [0.3])
    result = simulate(lane, 2, 2, Costs(0.1, 0.05, latency=0.2))
    assert sorted(span.nodeid for span in result.spans) == sorted(t.nodeid for t in lane)


def test_sizes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="needs more than the 4 devices"):
        simulate(lane_of("a.py", 8, [1.0]), 4, 4)


def test_nested_placement_beats_the_landed_one_on_the_lanes() -> None:
    """The same scheduler with each worker's blocks nested (placed for the worker count) against
    worker j's block j modulo the blocks: shorter on the median lane."""
    nested = [simulate(random_lane(seed), 8, 8).ratio for seed in range(20)]
    modulo = [simulate(random_lane(seed), cpu_devices(8), 8).ratio for seed in range(20)]
    assert statistics.median(nested) < statistics.median(modulo)


def test_a_stuck_session_is_an_error() -> None:
    """A scheduler that never sends anything leaves the tests unrun: the simulation says so
    instead of returning a makespan."""

    class Idle:
        def __init__(self, *args: object) -> None:
            self.nodes: list = []
            self.tests_finished = False

        def add_node(self, node: object) -> None:
            self.nodes.append(node)

        def add_node_collection(self, node: object, collection: object) -> None:
            pass

        def schedule(self) -> None:
            pass

    with pytest.raises(SimulationError, match="never ran"):
        simulate(lane_of("a.py", 1, [1.0]), 1, 1, scheduler=Idle)


@pytest.mark.parametrize(
    ("victim", "thief", "tail", "cost", "expected"),
    [
        (6.0, 1.0, [1.0] * 4, 0.3, (2, 4.0)),  # two of four: 4 s and 3.3 s
        (3.0, 0.0, [1.0], 0.3, (1, 2.0)),
        (2.0, 1.5, [1.0], 0.3, (0, 2.0)),  # moving one ends later (2.8 s)
        (5.0, 0.0, [], 0.3, (0, 5.0)),
    ],
)
def test_split_point(victim, thief, tail, cost, expected) -> None:
    """How many of a queue's last tests a steal takes: the count that ends both soonest."""
    count, finish = split_point(victim, thief, tail, cost)
    assert (count, pytest.approx(finish)) == expected


@pytest.mark.parametrize(
    ("durations", "most", "cost", "expected"),
    [
        ([1.0] * 16, 4, 0.3, [4, 4, 4, 4]),
        ([1.0] * 3, 8, 0.3, [1, 1, 1]),
        ([0.1, 0.1], 2, 0.3, [2]),  # a second gang start costs more than it saves
        ([3.0, 1.0, 1.0, 1.0], 2, 0.3, [1, 3]),
        ([1.0], 4, 0.0, [1]),
    ],
)
def test_split_evenly(durations, most, cost, expected) -> None:
    """The parts a unit goes out in, in order, none empty, the longest as short as may be."""
    sizes = split_evenly(durations, most, cost)
    assert sizes == expected and sum(sizes) == len(durations)


def test_k_gangs_share_one_device() -> None:
    """One device, K = 4 and four workers: four modules of ws1 tests run side by side, four gangs
    on the device at once, and the makespan is a quarter of the serial one."""
    lane = [t for m in range(4) for t in lane_of(f"m{m}.py", 1, [1.0] * 4)]
    result = simulate(lane, cpu_devices(1, 4, gangs_per_device=4), 4, Costs(0.1, 0.05))
    assert result.most_slots == 4
    assert result.makespan == pytest.approx(4.15)


@pytest.mark.parametrize("per_device", [2, 4])
def test_no_device_holds_more_than_k_gangs(per_device: int) -> None:
    devices = cpu_devices(8, 8 * per_device, gangs_per_device=per_device)
    for seed in range(20):
        result = simulate(random_lane(seed), devices, 8 * per_device)
        assert result.most_slots <= per_device


def test_an_exclusive_test_runs_alone_on_its_devices() -> None:
    """K = 2 on two devices: the exclusive ws2 test shares its devices with no other span."""
    lane = lane_of("a.py", 1, [0.5] * 6) + lane_of("b.py", 2, [0.5] * 3)
    lane.append(SimTest("c.py::alone", "c.py", 2, 1.0, exclusive=True))
    result = simulate(lane, cpu_devices(2, 4, gangs_per_device=2), 4, Costs(0.1, 0.05))
    alone = next(span for span in result.spans if span.nodeid == "c.py::alone")
    for span in result.spans:
        if span is not alone and set(span.devices) & set(alone.devices):
            assert span.end <= alone.start or alone.end <= span.start
    assert result.most_slots == 2


def test_an_exclusive_unit_goes_first_where_gangs_share_a_device() -> None:
    """One device, K = 4, and a test of m0 far longer than known (3 s, known as 0.5 s). The
    short exclusive unit runs first, while the device is free. Sent last (as units of its size
    and duration were), it waited for m0's long test: nothing else could be sent meanwhile, so
    the other workers held back their last (2 s) tests until then (makespan 6.4 s)."""
    lane = lane_of("m0.py", 1, [0.5, 3.0, 0.5, 0.5])
    lane += [t for m in (1, 2, 3) for t in lane_of(f"m{m}.py", 1, [0.5, 0.5, 0.5, 2.0])]
    lane += [SimTest(f"x.py::t{i}", "x.py", 1, 0.1, exclusive=True) for i in range(2)]
    known = {t.nodeid: 0.5 if t.module == "m0.py" else t.duration for t in lane}
    devices = cpu_devices(1, 4, gangs_per_device=4)
    result = simulate(lane, devices, 4, Costs(0.1, 0.05), known=known)
    alone = [span for span in result.spans if span.nodeid.startswith("x.py")]
    others = [span for span in result.spans if not span.nodeid.startswith("x.py")]
    assert max(span.end for span in alone) <= min(span.start for span in others)
    assert result.makespan == pytest.approx(5.0)
