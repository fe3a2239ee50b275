"""A clocked simulation of `--dist megatron`: the package's real `MegatronScheduling` against fake
workers. It lives with the benchmarks (and the tests) that use it: the plugin never runs it.

Pure: no torch, pytest or xdist, no processes, files or sleeps; a clock jumps from event to event,
so a lane of a minute simulates in milliseconds and the same inputs always give the same result.

The fake workers behave as xdist's do wherever the scheduler can tell (`xdist/remote.py`): a worker
runs its tests in the order sent and starts one only once the next one, or "shutdown", is in hand
(the held-back test); "steal" takes tests back from its queue, all of them or none, and answers
"unscheduled"; a worker that reaches "shutdown" leaves, and the controller takes it out of the
scheduler. The controller handles one event at a time and, as xdist's DSession does, shuts every
worker down once the scheduler says `tests_finished`.

A test runs as the driver runs it (`driver/pool.py`): a test of world size k first trims the
worker's gangs to the sizes the scheduler's plan still has for it, then needs the worker's gang of
k ranks (started on first use, and again after a trim: `Costs.gang_start`, before any lock), then
takes a slot of each device of its block one at a time in sorted order (every slot for an
`exclusive_devices` test), waiting for each (a waiting worker is served in arrival order, as the
locks' turnstile serves it), then pays `Costs.module` when its module is new to
that gang (the reset at a module boundary and the ranks collecting the module), then runs for its
duration. An unmarked test holds its worker's home device and pays neither cost. A device has
the DeviceSet's `gangs_per_device` slots; gangs that share one run no slower for it.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from xdist_megatron import placement, sidechannel
from xdist_megatron.controller.scheduler import MegatronScheduling
from xdist_megatron.protocol import INPUT_KEY
from xdist_megatron.sidechannel import ItemInfo

SHUTDOWN = -1  # xdist's shutdown marker, as it sits in a worker's queue of test indices


@dataclass(frozen=True)
class SimTest:
    """One test as the simulation needs it."""

    nodeid: str
    module: str
    world_size: int | None  # None: unmarked, run in the worker on its home device
    duration: float
    exclusive: bool = False  # `exclusive_devices`: every slot of its devices


@dataclass(frozen=True)
class Costs:
    """What running a test costs besides its body, in seconds."""

    gang_start: float = 0.1  # a gang forked from the warm zygote and joined (CPU: ~0.08 s)
    module: float = 0.05  # a gang's first test of a module: reset, and the ranks collect it
    latency: float = 0.0  # one message between the controller and a worker


@dataclass(frozen=True)
class Span:
    """Where and when one test's body ran."""

    nodeid: str
    worker: int
    devices: tuple[int, ...]
    start: float
    end: float


@dataclass
class Result:
    """What one simulated session did."""

    makespan: float  # from scheduling to the end of the last test body
    ideal: float  # `ideal_bound` of the same tests
    busy: dict[int, float]  # device -> seconds of test bodies on it
    spans: list[Span]
    gang_starts: int
    module_loads: int
    steals: int  # steal requests that took tests back
    most_slots: int  # the most slots of one device taken at once (at most gangs_per_device)

    @property
    def ratio(self) -> float:
        return self.makespan / self.ideal if self.ideal > 0 else 1.0


class SimulationError(RuntimeError):
    """The scheduler left the session stuck, lost a test, or ran one twice."""


Scheduler = Any  # MegatronScheduling, or another class with xdist's Scheduling protocol
SchedulerFactory = Callable[..., Scheduler]


def ideal_bound(tests: Sequence[SimTest], device_count: int, costs: Costs) -> float:
    """No schedule beats the device-seconds spread over every device (`device_count`: devices
    times the gangs each may hold), nor the longest test; and no test body starts before one
    gang has started and collected its module."""
    if not tests:
        return 0.0
    work = sum((t.world_size or 1) * t.duration for t in tests)
    longest = max(t.duration for t in tests)
    marked = any(t.world_size is not None for t in tests)
    start = costs.gang_start + costs.module if marked else 0.0
    return start + max(work / device_count, longest)


def simulate(
    tests: Sequence[SimTest],
    devices: placement.DeviceSet | int,
    workers: int,
    costs: Costs = Costs(),
    known: Mapping[str, float] | None = None,
    scheduler: SchedulerFactory = MegatronScheduling,
    session_dir: str | None = None,
    log: Callable[[str], None] | None = None,
) -> Result:
    """Run `tests` (in collection order) on `workers` fake xdist workers over `devices`: a count
    of CPU slots, placed as the plugin places them (for the worker count), or a DeviceSet used as
    it is (`cpu_devices`). `known`: the durations the scheduler is told (the last run's; default
    the true ones; {} for a first run). `scheduler`: the class to drive, built as the plugin
    builds it; `session_dir` is handed on to it (None: the plan stays in memory), and `log` gets
    its log lines with the clock's time in front."""
    if isinstance(devices, int):
        devices = cpu_devices(devices, workers)
    too_large = [t.nodeid for t in tests if (t.world_size or 1) > devices.count]
    if too_large:
        raise ValueError(f"{too_large[0]} needs more than the {devices.count} devices")
    if known is None:
        known = {t.nodeid: t.duration for t in tests}
    session = Session(tests, devices, workers, costs, known, scheduler, session_dir, log)
    return session.run()


def cpu_devices(count: int, workers: int = 0, gangs_per_device: int = 1) -> placement.DeviceSet:
    """`count` CPU slots placed for `workers` xdist workers, as the plugin places them; 0: as it
    placed them before it knew the worker count (worker j's block: j modulo the blocks)."""
    devices = placement.DeviceSet("cpu", tuple(range(count)), gangs_per_device=gangs_per_device)
    return placement.shared_by(devices, workers)


class Clock:
    """Events in time order (ties in the order they were made)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def after(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (self.now + delay, next(self._order), action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


class Locks:
    """`slots` per device: the slots taken, and the workers waiting in arrival order, each for
    the slots it needs (the first in line keeps later ones out, as the turnstile does)."""

    def __init__(self, clock: Clock, slots: int) -> None:
        self.clock = clock
        self.slots = slots
        self.taken: Counter[int] = Counter()
        self.most = 0  # the most slots of one device ever taken at once
        self.waiting: dict[int, deque[tuple[SimWorker, int]]] = {}

    def take(self, worker: SimWorker, device: int, need: int) -> bool:
        """Take `need` slots now (True), or queue for them (False: `worker.granted` is called
        later)."""
        queue = self.waiting.setdefault(device, deque())
        if not queue and self.taken[device] + need <= self.slots:
            self._add(device, need)
            return True
        queue.append((worker, need))
        return False

    def release(self, device: int, need: int) -> None:
        self.taken[device] -= need
        queue = self.waiting.get(device)
        while queue and self.taken[device] + queue[0][1] <= self.slots:
            successor, wanted = queue.popleft()
            self._add(device, wanted)
            self.clock.after(0.0, successor.granted)

    def _add(self, device: int, need: int) -> None:
        self.taken[device] += need
        self.most = max(self.most, self.taken[device])


class Session:
    """The controller's side: the scheduler, the workers, the clock and what happened."""

    def __init__(
        self,
        tests: Sequence[SimTest],
        devices: placement.DeviceSet,
        workers: int,
        costs: Costs,
        known: Mapping[str, float],
        scheduler: SchedulerFactory,
        session_dir: str | None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.tests = list(tests)
        self.devices = devices
        self.costs = costs
        self.clock = Clock()
        self.locks = Locks(self.clock, devices.gangs_per_device)
        infos = {t.nodeid: ItemInfo(t.module, t.world_size, None, t.exclusive) for t in self.tests}
        timed = None if log is None else (lambda line: log(f"{self.clock.now:8.3f} {line}"))
        self.sched = scheduler(
            None, devices, workers, lambda: infos, dict(known), session_dir, timed
        )
        self.workers = [SimWorker(self, index) for index in range(workers)]
        self.spans: list[Span] = []
        self.gang_starts = self.module_loads = self.steals = 0

    def run(self) -> Result:
        collection = [t.nodeid for t in self.tests]
        for worker in self.workers:
            self.sched.add_node(worker)
        for worker in self.workers:
            self.sched.add_node_collection(worker, collection)
        self.to_controller(self.sched.schedule)
        self.clock.run()
        self._check_every_test_ran_once()
        return self._result()

    def to_worker(self, action: Callable[[], None]) -> None:
        self.clock.after(self.costs.latency, action)

    def to_controller(self, action: Callable[[], None]) -> None:
        """An event for the controller: handled, then DSession's shutdown check."""

        def handle() -> None:
            action()
            if self.sched.tests_finished:
                for node in self.sched.nodes:
                    node.shutdown()

        self.clock.after(self.costs.latency, handle)

    def worker_left(self, worker: SimWorker) -> None:
        crashed = self.sched.remove_node(worker)
        if crashed is not None:
            raise SimulationError(f"{worker.gateway.id} left with {crashed} still pending")

    def plan_sizes(self, worker: int) -> set[int] | None:
        """World sizes the scheduler's plan still has for `worker` (None: it keeps no plan in
        memory, so the worker keeps its gangs). Read with getattr: bench/sim_lanes.py runs an
        earlier scheduler, which has no `plan`, through this simulator too."""
        plan = getattr(self.sched, "plan", None)
        return None if plan is None else sidechannel.sizes_in_plan(plan, worker)

    def _check_every_test_ran_once(self) -> None:
        ran = Counter(span.nodeid for span in self.spans)
        never = [t.nodeid for t in self.tests if t.nodeid not in ran]
        twice = [nodeid for nodeid, count in ran.items() if count > 1]
        if never or twice:
            states = "; ".join(worker.describe() for worker in self.workers)
            raise SimulationError(f"never ran: {never[:5]}, ran twice: {twice[:5]} ({states})")

    def _result(self) -> Result:
        busy = dict.fromkeys(self.devices.ids, 0.0)
        for span in self.spans:
            for device in span.devices:
                busy[device] += span.end - span.start
        return Result(
            makespan=max((span.end for span in self.spans), default=0.0),
            ideal=ideal_bound(
                self.tests, self.devices.count * self.devices.gangs_per_device, self.costs
            ),
            busy=busy,
            spans=self.spans,
            gang_starts=self.gang_starts,
            module_loads=self.module_loads,
            steals=self.steals,
            most_slots=self.locks.most,
        )


class SimWorker:
    """An xdist worker as the scheduler sees it (`WorkerController`'s attributes) and as its
    driver runs tests."""

    def __init__(self, session: Session, index: int) -> None:
        self.session = session
        self.index = index
        self.gateway = SimpleNamespace(id=f"gw{index}")
        self.workerinput = {INPUT_KEY: {"worker": index}}
        self.shutting_down = False
        self.queue: deque[int] = deque()  # xdist's `torun`
        self.next: int | None = None  # taken from the queue: the test it runs after this one
        self.running: int | None = None
        self.gone = False
        self.gangs: dict[int, str | None] = {}  # world size -> the module its gang last ran
        self.wanted: list[int] = []  # device locks still to take, in order
        self.held: list[int] = []

    # -- what the controller calls ------------------------------------------------------------

    def send_runtest_some(self, indices: Sequence[int]) -> None:
        batch = list(indices)
        self.session.to_worker(lambda: self._receive(batch))

    def send_steal(self, indices: Sequence[int]) -> None:
        wanted = list(indices)
        self.session.to_worker(lambda: self._steal(wanted))

    def shutdown(self) -> None:
        if not self.shutting_down:
            self.shutting_down = True
            self.session.to_worker(lambda: self._receive([SHUTDOWN]))

    def describe(self) -> str:
        queue = list(self.queue)
        return f"{self.gateway.id}: running {self.running}, next {self.next}, queue {queue}"

    # -- xdist's worker loop ------------------------------------------------------------------

    def _receive(self, indices: list[int]) -> None:
        self.queue.extend(indices)
        self._advance()

    def _steal(self, indices: list[int]) -> None:
        """Give back the requested tests if every one is still queued, else none."""
        if self.gone:
            return
        wanted = set(indices)
        stolen = [i for i in self.queue if i in wanted]
        if len(stolen) == len(wanted):
            self.queue = deque(i for i in self.queue if i not in wanted)
            self.session.steals += bool(stolen)
        else:
            stolen = []
        sched = self.session.sched
        self.session.to_controller(lambda: sched.remove_pending_tests_from_node(self, stolen))

    def _advance(self) -> None:
        """Take the first test; run a test only once the one after it (or shutdown) is in hand."""
        if self.running is not None or self.gone:
            return
        if self.next is None:
            if not self.queue:
                return
            self.next = self.queue.popleft()
        if self.next == SHUTDOWN:
            self.gone = True
            self.session.to_controller(lambda: self.session.worker_left(self))
            return
        if self.queue:
            self.running, self.next = self.next, self.queue.popleft()
            self._start(self.running)

    # -- the driver running one test ----------------------------------------------------------

    def _start(self, index: int) -> None:
        test = self.session.tests[index]
        world_size = test.world_size
        self.wanted = sorted(placement.devices_of(self.session.devices, self.index, world_size))
        if world_size is None:
            self._take_locks()
            return
        self._trim(world_size)
        if world_size in self.gangs:
            self._take_locks()
            return
        self.gangs[world_size] = None
        self.session.gang_starts += 1
        self.session.clock.after(self.session.costs.gang_start, self._take_locks)

    def _trim(self, world_size: int) -> None:
        """Shut down the gangs of sizes the plan no longer has for this worker."""
        needed = self.session.plan_sizes(self.index)
        if needed is not None:
            for size in [s for s in self.gangs if s not in needed | {world_size}]:
                del self.gangs[size]

    def _take_locks(self) -> None:
        assert self.running is not None
        need = self.session.devices.slots_for(self.session.tests[self.running].exclusive)
        while self.wanted:
            if not self.session.locks.take(self, self.wanted[0], need):
                return
            self.held.append(self.wanted.pop(0))
        self._body()

    def granted(self) -> None:
        """The lock this worker waited for was handed over to it."""
        self.held.append(self.wanted.pop(0))
        self._take_locks()

    def _body(self) -> None:
        assert self.running is not None
        test = self.session.tests[self.running]
        setup = 0.0
        if test.world_size is not None and self.gangs[test.world_size] != test.module:
            self.gangs[test.world_size] = test.module
            self.session.module_loads += 1
            setup = self.session.costs.module
        start = self.session.clock.now + setup
        self.session.clock.after(setup + test.duration, lambda: self._finish(start))

    def _finish(self, start: float) -> None:
        index, self.running = self.running, None
        assert index is not None
        test = self.session.tests[index]
        now = self.session.clock.now
        self.session.spans.append(Span(test.nodeid, self.index, tuple(self.held), start, now))
        need = self.session.devices.slots_for(test.exclusive)
        for device in self.held:
            self.session.locks.release(device, need)
        self.held = []
        sched = self.session.sched
        self.session.to_controller(lambda: sched.mark_test_complete(self, index, test.duration))
        self._advance()


def random_lane(
    seed: int,
    modules: int = 10,
    tests: int = 60,
    weights: Mapping[int, float] | None = None,
    durations: tuple[float, float] = (0.2, 1.5),
) -> list[SimTest]:
    """`tests` tests, as many in each of `modules` modules as they divide, world sizes drawn by
    `weights` (default 1:4, 2:3, 4:2, 8:1), durations uniform in `durations` (seconds); the same
    lane for the same seed."""
    rng = random.Random(seed)
    weights = weights or {1: 4, 2: 3, 4: 2, 8: 1}
    sizes = rng.choices(list(weights), weights=list(weights.values()), k=tests)
    lane = []
    for number, world_size in enumerate(sizes):
        module = f"test_m{number % modules:02d}.py"
        duration = round(rng.uniform(*durations), 3)
        lane.append(SimTest(f"{module}::test_{number:03d}", module, world_size, duration))
    return sorted(lane, key=lambda t: t.module)  # collection order: module by module
