"""MegatronScheduling driven by plain-data stand-ins for xdist's controller and workers.

`Run` plays xdist: it hands the scheduler worker stand-ins, completes their tests the way an
xdist worker does (a worker runs its first pending test only once a second one or "shutdown"
has arrived: the held-back test) and triggers shutdown when `tests_finished` says so, as
xdist's DSession does. The placement tables at the end pin the device arithmetic it relies on.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from xdist_megatron.controller.scheduler import MegatronScheduling
from xdist_megatron.placement import (
    DeviceSet,
    gang_slot,
    home_device,
    positions,
    shared_by,
    worker_block,
)
from xdist_megatron.protocol import INPUT_KEY
from xdist_megatron.sidechannel import ItemInfo

CPU8 = DeviceSet("cpu", tuple(range(8)))


class Worker:
    """The part of xdist's WorkerController the scheduler uses; `queue` is what the real worker
    would hold: indices sent to it and not completed yet, in order."""

    def __init__(self, run: Run, index: int) -> None:
        self.run = run
        self.index = index
        self.gateway = SimpleNamespace(id=f"gw{index}")
        self.workerinput = {INPUT_KEY: {"worker": index}}
        self.shutting_down = False
        self.queue: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.run.record_send(self, list(indices))
        self.queue.extend(indices)

    def send_steal(self, indices: list[int]) -> None:
        self.run.steal_requests.append((self, list(indices)))

    def shutdown(self) -> None:
        self.shutting_down = True

    @property
    def runnable(self) -> bool:
        return len(self.queue) >= 2 or (self.shutting_down and bool(self.queue))


class Run:
    """One scheduled session: items are `{nodeid: world size or None}` in collection order."""

    def __init__(
        self,
        tmp_path,
        items: dict[str, int | None],
        workers: int = 2,
        devices: DeviceSet = CPU8,
        durations: dict[str, float] | None = None,
    ) -> None:
        self.collection = list(items)
        self.sizes = [items[nodeid] for nodeid in self.collection]
        infos = {n: ItemInfo(n.split("::")[0], s, None) for n, s in items.items()}
        self.devices = devices
        self.sched = MegatronScheduling(
            None, devices, workers, lambda: infos, durations or {}, str(tmp_path)
        )
        self.workers = [Worker(self, i) for i in range(workers)]
        self.sends: list[tuple[int, list[str]]] = []
        self.overlapping_sends: list[tuple[int, list[str]]] = []
        self.completed: list[int] = []
        self.crashed: list[str] = []
        self.steal_requests: list[tuple[Worker, list[int]]] = []

    # -- what the scheduler sees --------------------------------------------------------------

    def start(self, order: list[int] | None = None) -> Run:
        joining = [self.workers[i] for i in order] if order else self.workers
        for worker in joining:
            self.sched.add_node(worker)
        for worker in joining:
            self.sched.add_node_collection(worker, self.collection)
        self.sched.schedule()
        self._dsession_check()
        return self

    def complete(self, worker: Worker) -> None:
        """The worker's running test finished."""
        assert worker.runnable, f"gw{worker.index} holds back its only test"
        index = worker.queue.pop(0)
        self.completed.append(index)
        self.sched.mark_test_complete(worker, index)
        self._dsession_check()

    def crash(self, worker: Worker) -> str | None:
        """The worker died: xdist takes it out of the scheduler (`replace` starts its successor)."""
        self.workers.remove(worker)
        crashed = self.sched.remove_node(worker)
        if crashed is not None:
            self.crashed.append(crashed)
        self._dsession_check()
        return crashed

    def replace(self, index: int) -> Worker:
        """xdist's replacement for a crashed worker: it inherits the index (from the spec env)."""
        worker = Worker(self, index)
        self.workers.append(worker)
        self.sched.add_node(worker)
        self.sched.add_node_collection(worker, self.collection)
        self.sched.schedule()
        self._dsession_check()
        return worker

    def answer_steals(self) -> None:
        """Each worker asked to give tests back does as xdist's does: all of them if all are
        still in its queue (past the test it runs and the one it took to follow), else none."""
        while self.steal_requests:
            worker, indices = self.steal_requests.pop(0)
            if worker not in self.workers:
                continue  # it crashed: it answers nothing
            stealable = worker.queue[2:]
            stolen = indices if all(i in stealable for i in indices) else []
            worker.queue = [i for i in worker.queue if i not in stolen]
            self.sched.remove_pending_tests_from_node(worker, stolen)
            self._dsession_check()

    def finish(self, seed: int = 0) -> None:
        """Complete tests in a seeded random order among the workers able to run one."""
        rng = random.Random(seed)
        self.answer_steals()
        while runnable := [w for w in self.workers if w.runnable]:
            self.complete(rng.choice(runnable))
            self.answer_steals()

    def _dsession_check(self) -> None:
        if self.sched.tests_finished:
            for worker in self.sched.nodes:
                worker.shutdown()

    # -- what the test checks -----------------------------------------------------------------

    def record_send(self, worker: Worker, indices: list[int]) -> None:
        """Note each send, and apart any whose devices overlap the tests of another worker that
        is running (all its pending tests: it runs them in turn)."""
        nodeids = [self.collection[i] for i in indices]
        self.sends.append((worker.index, nodeids))
        if self._positions(worker, indices) & self._busy(exclude=worker):
            self.overlapping_sends.append((worker.index, nodeids))

    def _positions(self, worker: Worker, indices: list[int]) -> frozenset[int]:
        found: frozenset[int] = frozenset()
        for index in indices:
            found |= positions(self.devices, worker.index, self.sizes[index])
        return found

    def _busy(self, exclude: Worker) -> frozenset[int]:
        """Devices of the workers that run: a worker holding back one test runs nothing."""
        found: frozenset[int] = frozenset()
        for worker in self.workers:
            if worker is not exclude and worker.runnable:
                found |= self._positions(worker, worker.queue)
        return found

    @property
    def stuck(self) -> bool:
        """After finish(): tests remain that no worker will run, so xdist would wait forever."""
        return len(self.completed) + len(self.crashed) < len(self.collection)


def test_units_group_module_and_world_size(tmp_path):
    """Tests of one (module, world size) go to one worker together, in collection order, and no
    send mixes modules or sizes: a gang serves the whole unit, a module boundary is crossed once."""
    items = {
        "a.py::t1": 2,
        "a.py::t2": None,
        "a.py::t3": 2,
        "a.py::t4": 1,
        "b.py::t1": 2,
        "a.py::t5": None,
        "b.py::t2": 2,
    }
    run = Run(tmp_path, items, workers=1).start()
    run.finish()
    assert [nodeids for _, nodeids in run.sends] == [
        ["a.py::t1", "a.py::t3"],
        ["b.py::t1", "b.py::t2"],
        ["a.py::t2", "a.py::t5"],
        ["a.py::t4"],
    ]
    assert sorted(run.completed) == list(range(len(items)))


def test_larger_world_sizes_first(tmp_path):
    """The largest gangs start first, while every device is still free."""
    items = {f"m{size}.py::t": size for size in (1, 4, None, 8, 2)}
    run = Run(tmp_path, items, workers=1).start()
    run.finish()
    assert [nodeids[0] for _, nodeids in run.sends] == [
        "m8.py::t",
        "m4.py::t",
        "m2.py::t",
        "m1.py::t",
        "mNone.py::t",
    ]


def test_known_durations_go_longest_first(tmp_path):
    """Among units of one size the longest known total goes first; an unknown test counts as
    the median known duration (2 s here), so c (1 unknown + 0.5) ranks between b and a."""
    items = {"a.py::t1": 2, "a.py::t2": 2, "b.py::t1": 2, "c.py::t1": 2, "c.py::t2": 2}
    durations = {"a.py::t1": 0.5, "a.py::t2": 0.5, "b.py::t1": 9.0, "c.py::t1": 2.0}
    run = Run(tmp_path, items, workers=1, durations=durations).start()
    run.finish()
    assert [nodeids[0].split("::")[0] for _, nodeids in run.sends] == ["b.py", "c.py", "a.py"]


MIXED = {
    **{f"m{m}.py::t{size}_{i}": size for m in range(3) for size in (8, 4, 2, 1) for i in range(2)},
    **{f"m{m}.py::plain{i}": None for m in range(3) for i in range(3)},
}


@pytest.mark.parametrize(("workers", "seed"), [(2, 0), (3, 1), (4, 2), (4, 3), (8, 4)])
def test_never_sends_onto_a_running_workers_devices(tmp_path, workers, seed):
    """A unit goes only to devices clear of every running worker's pending tests, so the gangs
    that run at once are on disjoint devices; every test runs exactly once."""
    run = Run(tmp_path, MIXED, workers=workers).start()
    run.finish(seed)
    assert run.overlapping_sends == []
    assert sorted(run.completed) == list(range(len(MIXED)))
    assert all(w.shutting_down for w in run.workers)


@pytest.mark.parametrize(
    ("items", "workers"),
    [
        ({"a.py::t": None, "b.py::t": 2, "c.py::t": 2, "d.py::t[ws8]": 8}, 3),
        ({"a.py::t[ws8]": 8, "b.py::t": 2, "c.py::t": 2, "d.py::t": None, "e.py::t": None}, 4),
    ],
)
def test_held_back_tests_do_not_deadlock(tmp_path, items, workers):
    """On 4 devices a skipped ws8 test occupies none, two ws2 gangs sit on disjoint blocks and
    every unmarked test's home device is under one of them, so each worker ends up holding
    back one test. xdist sends nothing until a worker completes a test: the scheduler must
    give some worker a second test (the 4-worker case waited forever at 788461f)."""
    run = Run(tmp_path, items, workers=workers, devices=DeviceSet("cpu", (0, 1, 2, 3))).start()
    assert any(w.runnable for w in run.workers), run.sends
    run.finish()
    assert not run.stuck


def test_a_worker_is_filled_before_the_next(tmp_path):
    """A worker given a single test holds it back and reserves nothing, so it gets a second unit
    before any other worker is served: otherwise the others' work takes its devices and the
    held-back test waits (two ws8 units: the second would wait for the whole queue)."""
    items = {"a.py::t": 8, "b.py::t": 8, "c.py::t": 1, "d.py::t": 1}
    run = Run(tmp_path, items, workers=4).start()
    assert run.sends == [(0, ["a.py::t"]), (0, ["b.py::t"])]
    run.complete(run.workers[0])
    assert run.sends[2] == (0, ["c.py::t"]), "the held-back worker is served first"
    run.finish()
    assert not run.stuck


@pytest.mark.xfail(
    strict=True,
    reason="product bug: scheduler._fill serves workers with equally many pending tests in index "
    "order, so worker 0 takes c, the only unit that fits beside worker 1's held-back b, and b "
    "waits for the end of the queue",
)
def test_a_test_on_free_devices_is_not_left_held_back(tmp_path):
    """Three ws4 and two ws2 tests (one per module), 2 workers on 8 devices: worker 0 runs a on
    0-3, worker 1 gets b on 4-7. Worker 1 runs b only once a second unit arrives; c fits its
    block 4-7 and d, e fit worker 0's, so both workers can run at once from the start."""
    items = {"a.py::t": 4, "b.py::t": 4, "c.py::t": 4, "d.py::t": 2, "e.py::t": 2}
    run = Run(tmp_path, items, workers=2).start()
    assert run.sched.queue, "work is left, so no worker is told to shut down"
    assert [w.runnable for w in run.workers] == [True, True], run.sends


def test_with_nested_blocks_a_test_on_free_devices_is_not_left_held_back(tmp_path):
    """The case above, with the blocks placed for the two workers as the plugin places them:
    worker 1's ws2 block (4-5) lies inside its ws4 one (4-7), so d follows c there and both
    workers run from the start."""
    items = {"a.py::t": 4, "b.py::t": 4, "c.py::t": 4, "d.py::t": 2, "e.py::t": 2}
    run = Run(tmp_path, items, workers=2, devices=shared_by(CPU8, 2)).start()
    assert [w.runnable for w in run.workers] == [True, True], run.sends
    run.finish()
    assert sorted(run.completed) == list(range(len(items))) and not run.overlapping_sends


def test_crashed_worker_returns_its_running_test_and_requeues_the_rest(tmp_path):
    """remove_node names the running test as the crash item; the tests queued behind it run on
    the replacement (same index, same devices), and nothing runs twice."""
    items = {"a.py::t1": 2, "a.py::t2": 2, "a.py::t3": 2, "b.py::t1": 8}
    run = Run(tmp_path, items, workers=1).start()
    (worker,) = run.workers
    run.complete(worker)  # b.py::t1, the ws8 test, ran first
    assert run.crash(worker) == "a.py::t1"
    assert run.sched.has_pending
    replacement = run.replace(0)
    run.finish()
    assert run.sends[-1] == (0, ["a.py::t2", "a.py::t3"])
    assert replacement.shutting_down
    assert sorted(run.collection[i] for i in run.completed) == ["a.py::t2", "a.py::t3", "b.py::t1"]


def test_crash_work_goes_to_a_live_worker_at_once(tmp_path):
    """The requeued tests need not wait for the replacement: a live worker that is not shutting
    down takes them as soon as it has room (here once it completes a test)."""
    items = {f"{m}.py::t{i}": 4 for m in "abc" for i in range(3 if m == "a" else 2)}
    run = Run(tmp_path, items, workers=2).start()
    first, second = run.workers
    assert run.sends == [(0, ["a.py::t0", "a.py::t1", "a.py::t2"]), (1, ["b.py::t0", "b.py::t1"])]
    assert run.crash(first) == "a.py::t0"
    run.complete(second)
    assert run.sends[2] == (1, ["a.py::t1", "a.py::t2"])
    run.finish()
    assert sorted(run.collection[i] for i in run.completed) == sorted(set(items) - {"a.py::t0"})


@pytest.mark.parametrize("seed", range(3))
def test_crash_mid_run_loses_nothing(tmp_path, seed):
    """A worker dies part-way through a mixed lane: each test but the crash item still runs
    exactly once, and the requeued units obey the same device rule."""
    run = Run(tmp_path, MIXED, workers=4).start()
    rng = random.Random(seed)
    for _ in range(10):
        run.complete(rng.choice([w for w in run.workers if w.runnable]))
    victim = next(w for w in run.workers if len(w.queue) >= 2)
    crashed = run.crash(victim)
    run.replace(victim.index)
    run.finish(seed)
    assert crashed is not None and crashed not in {run.collection[i] for i in run.completed}
    assert sorted(run.completed + [run.collection.index(crashed)]) == list(range(len(MIXED)))
    assert run.overlapping_sends == []


TAIL = {**{f"a.py::t{i}": 1 for i in range(6)}, "b.py::t0": 1}  # on 2 devices, 2 workers
CPU2 = DeviceSet("cpu", (0, 1))


def test_a_worker_with_a_short_queue_steals_the_end_of_a_long_one(tmp_path):
    """Worker 1's one test leaves it idle beside worker 0's six: it asks for the end of worker
    0's queue (past the test running and the one taken to follow it), and runs what it gets."""
    run = Run(tmp_path, TAIL, workers=2, devices=CPU2).start()
    [(victim, indices)] = run.steal_requests
    assert victim.index == 0 and indices == [4, 5]
    run.answer_steals()
    assert run.sends[-1] == (1, ["a.py::t4", "a.py::t5"])
    run.finish()
    assert sorted(run.completed) == list(range(len(TAIL))) and not run.overlapping_sends


def test_a_steal_of_tests_already_begun_gets_none_and_loses_nothing(tmp_path):
    """The victim answers with none when it has taken a requested test meanwhile; the scheduler
    keeps its tests where they are and every test runs once."""
    run = Run(tmp_path, TAIL, workers=2, devices=CPU2).start()
    victim = run.workers[0]
    run.complete(victim)
    run.complete(victim)
    run.complete(victim)  # t4 is running and t5 taken to follow it: neither can be stolen now
    run.finish()
    assert sorted(run.completed) == list(range(len(TAIL)))
    assert not run.sched.steal and not run.stuck


def test_a_victim_that_crashes_during_a_steal_answers_nothing(tmp_path):
    """Its queue is requeued as after any crash; nothing waits for its answer."""
    run = Run(tmp_path, TAIL, workers=2, devices=CPU2).start()
    victim = run.workers[0]
    crashed = run.crash(victim)
    run.finish()
    assert crashed == "a.py::t0"
    assert sorted(run.completed) == [i for i in range(len(TAIL)) if run.collection[i] != crashed]


def test_tests_stolen_for_a_worker_that_crashed_go_back_to_the_queue(tmp_path):
    """The answer comes for a worker that is gone: its tests are queued again and run."""
    run = Run(tmp_path, TAIL, workers=2, devices=CPU2).start()
    thief = run.workers[1]
    assert run.crash(thief) == "b.py::t0"
    run.finish()
    assert sorted(run.collection[i] for i in run.completed) == sorted(set(TAIL) - {"b.py::t0"})
    assert not run.stuck


def test_a_test_marked_pending_runs_again(tmp_path):
    """A `pytest_handlecrashitem` hook that hands the crashed test back has it scheduled again."""
    run = Run(tmp_path, TAIL, workers=2, devices=CPU2).start()
    crashed = run.crash(run.workers[0])
    run.replace(0)
    run.sched.mark_test_pending(crashed)
    run.finish()
    assert sorted(run.completed) == list(range(len(TAIL)))


def test_an_idle_workers_block_takes_part_of_the_only_unit(tmp_path):
    """One module of eight ws1 tests and four workers: the unit goes out in four parts at once,
    each to a worker of its own, rather than three workers idling."""
    items = {f"a.py::t{i}": 1 for i in range(8)}
    run = Run(tmp_path, items, workers=4, devices=DeviceSet("cpu", (0, 1, 2, 3))).start()
    assert sorted((w, len(nodeids)) for w, nodeids in run.sends) == [(0, 2), (1, 2), (2, 2), (3, 2)]
    run.finish()
    assert sorted(run.completed) == list(range(8)) and not run.overlapping_sends


def test_worker_without_pending_tests_leaves_no_crash_item(tmp_path):
    """A worker that finishes (or dies) with nothing pending reports no crashed test."""
    run = Run(tmp_path, {"a.py::t1": 2}, workers=2).start()
    idle = next(w for w in run.workers if not w.queue)
    assert run.crash(idle) is None


def test_all_workers_shut_down_once_the_queue_is_empty(tmp_path):
    """When the last unit is sent every worker is told to shut down, so held-back tests run."""
    items = {"a.py::t": 1, "b.py::t": 1, "c.py::t": None}
    run = Run(tmp_path, items, workers=2).start()
    assert not run.sched.queue
    assert all(w.shutting_down for w in run.workers)
    run.finish()
    assert sorted(run.completed) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(3))
def test_a_size_that_fits_once_runs_on_one_gang(tmp_path, seed):
    """ws8 on 8 devices can run on one worker at a time anyway: all six modules' ws8 tests go
    to the worker that has that gang, instead of each worker forking one of its own."""
    items = {f"m{m}.py::t{i}": size for m in range(6) for i, size in enumerate((8, 4, 1, 1))}
    run = Run(tmp_path, items, workers=4).start()
    run.finish(seed)
    ws8_workers = {w for w, nodeids in run.sends if items[nodeids[0]] == 8}
    assert len(ws8_workers) == 1, run.sends
    assert not run.stuck and not run.overlapping_sends


def test_identical_inputs_give_identical_assignments(tmp_path):
    """Two runs of one suite schedule alike, even when workers register in another order."""
    runs = []
    for order in ([0, 1, 2, 3], [0, 1, 2, 3], [3, 1, 0, 2]):
        run = Run(tmp_path, MIXED, workers=4).start(order)
        run.finish(seed=7)
        runs.append(run.sends)
    assert runs[0] == runs[1] == runs[2]


# -- placement tables ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("worker", "size", "count", "slot"),
    [
        (0, 1, 8, 0),
        (7, 1, 8, 7),
        (9, 1, 8, 1),
        (1, 2, 8, 1),
        (3, 2, 8, 3),
        (5, 2, 8, 1),
        (1, 4, 8, 1),
        (2, 4, 8, 0),
        (3, 4, 8, 1),
        (3, 8, 8, 0),
        (1, 3, 8, 1),
        (2, 3, 8, 0),
        (0, 16, 8, None),
        (0, 0, 8, None),
        (0, 1, 0, None),
    ],
)
def test_gang_slot(worker, size, count, slot):
    """A worker uses its own aligned block when it exists, else its index modulo the blocks."""
    assert gang_slot(worker, size, count) == slot


@pytest.mark.parametrize(
    ("devices", "worker", "size", "block"),
    [
        (CPU8, 0, 2, (0, 1)),
        (CPU8, 3, 2, (6, 7)),
        (CPU8, 5, 2, (2, 3)),
        (CPU8, 1, 4, (4, 5, 6, 7)),
        (CPU8, 2, 4, (0, 1, 2, 3)),
        (CPU8, 3, 8, tuple(range(8))),
        (CPU8, 1, 3, (3, 4, 5)),
        (CPU8, 0, 9, None),
        (DeviceSet("cuda", (1, 3, 5, 6)), 1, 2, (5, 6)),
        (DeviceSet("cuda", (1, 3, 5, 6)), 3, 2, (5, 6)),
    ],
)
def test_worker_block(devices, worker, size, block):
    """Worker j's gang of k ranks: [j*k, (j+1)*k) of the run's devices when it fits, else modulo."""
    assert worker_block(devices, worker, size) == block


@pytest.mark.parametrize(
    ("devices", "worker", "size", "expected"),
    [
        (CPU8, 3, None, {3}),
        (CPU8, 10, None, {2}),
        (DeviceSet("cuda", (4, 6)), 1, None, {6}),
        (CPU8, 1, 2, {2, 3}),
        (CPU8, 2, 4, {0, 1, 2, 3}),
        (CPU8, 0, 16, set()),
    ],
)
def test_positions(devices, worker, size, expected):
    """What a pending test occupies: the home device (unmarked), the gang's block, or nothing
    for a size that is skipped because it does not fit."""
    assert positions(devices, worker, size) == frozenset(expected)
    if size is None:
        assert positions(devices, worker, size) == {home_device(devices, worker)}
