"""`--dist megatron`: xdist scheduling of (module, world size) units onto device blocks.

Units are all tests of one module with one world size (unmarked tests: one unit per module, on
the worker's home device; `exclusive_devices` tests: units of their own). The units that take
the most device slots go first (the largest sizes, and exclusive units where a device holds
several gangs), then the longest known durations; a worker gets a unit only when each of the
unit's devices has a slot free of the other workers' pending work (`gangs_per_device` slots per
device, all of them for an exclusive unit), so gangs on disjoint devices, and up to K gangs on
one, run at once. A worker holding back a test is served first and filled until it is busy
(`BUSY_PENDING`) before the next worker, and a unit goes to the worker that already has a gang
of its size on the same devices.

A unit stays whole (its tests share one gang start and one collection of the module) unless
splitting it shortens the makespan by the estimated durations, a part run elsewhere paying
`SPLIT_COST` (its own gang start and collection). Sent while other blocks of its size sit idle
(empty workers that nothing else queued fits), a unit goes out in a part per such block; and a
worker that nothing queued fits (the tail) steals, as xdist's `worksteal` does, the end of
another worker's queue where both then finish sooner. With nothing queued and nothing to steal,
every worker is told to shut down (which lets its held-back test run). A worker's blocks nest
(`placement.gang_slot`), so after a large gang it goes on with smaller ones on devices it had.
Device locks in the workers keep all this safe even when the scheduler has to break a wait (see
`_unblock`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import placement, sidechannel
from ..ci import sharding
from ..protocol import INPUT_KEY, module_of
from ..sidechannel import ItemInfo
from .splitting import split_evenly, split_point

if TYPE_CHECKING:
    import pytest
    from xdist.workermanage import WorkerController

# xdist runs a worker's last pending test only once another one (or "shutdown") has arrived: a
# worker is busy only while it has this many pending, and one with fewer holds its test back.
# The same two are out of reach of a steal: the running test and the one taken to follow it.
BUSY_PENDING = 2
# Seconds a split unit is assumed to cost the worker that takes part of it: a gang start (0.1 s
# warm on CPU, 0.2-0.4 s on a GPU) and its ranks collecting the module again.
SPLIT_COST = 0.3


@dataclass
class Unit:
    """Tests of one module and one world size, sent to one worker together."""

    module: str
    world_size: int | None  # None: unmarked tests, run in the worker itself
    exclusive: bool = False  # `exclusive_devices` tests: every slot of their devices
    nodeids: list[str] = field(default_factory=list)
    duration: float = 0.0
    whole: bool = False  # one class that must run on one worker: never split nor stolen from

    def priority(self, devices: placement.DeviceSet) -> tuple:
        """Most device slots first (world size times the slots a gang takes of each device):
        what needs the most free at once is sent while it is free. An exclusive unit left for
        the tail would wait for every other gang on its devices, while their workers hold back
        their last tests, as nothing else may be sent."""
        slots = (self.world_size or 1) * devices.slots_for(self.exclusive)
        return (-slots, -(self.world_size or 1), -self.duration, self.module)


@dataclass(frozen=True)
class Steal:
    """A steal request in flight: tests asked back from `victim` for `thief`."""

    victim: WorkerController
    thief: WorkerController
    indices: tuple[int, ...]


class MegatronScheduling:
    """xdist's Scheduling protocol over `placement`'s pure device functions."""

    def __init__(
        self,
        config: pytest.Config | None,
        devices: placement.DeviceSet,
        worker_count: int,
        item_info: Callable[[], dict[str, ItemInfo]],  # read once collection is done
        durations: dict[str, float],
        session_dir: str | None,  # None: the plan stays in memory (the simulator)
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.devices = devices
        self.worker_count = worker_count
        self._item_info = item_info
        self._durations = durations
        self.log = log
        self.session_dir = session_dir
        self.collections: dict[WorkerController, list[str]] = {}
        self.pending: dict[WorkerController, list[int]] = {}
        self.queue: list[Unit] = []
        self.collection: list[str] | None = None
        self.infos: dict[str, ItemInfo] = {}
        self.index_of: dict[str, int] = {}  # the scheduler's index of each test
        # Each worker's own index of each test: workers may collect the same tests in another
        # order (parametrize over a set, under each process's hash seed), and xdist's messages
        # carry the worker's indices.
        self.local_index: dict[WorkerController, dict[str, int]] = {}
        self.collected_by = ""  # the worker whose collection the scheduler's indices are
        self.estimates: dict[int, float] = {}  # seconds per test index: known, else typical
        self.world_sizes_sent: dict[WorkerController, set[int | None]] = {}  # each worker's gangs
        self.steal: Steal | None = None  # at most one request in flight, as in `worksteal`
        self.plan: dict | None = None  # the world sizes still to come (`sidechannel.plan`)

    # -- the protocol -----------------------------------------------------------------------

    @property
    def nodes(self) -> list[WorkerController]:
        return list(self.pending)

    @property
    def collection_is_completed(self) -> bool:
        return self.collection is not None or len(self.collections) >= self.worker_count

    @property
    def tests_finished(self) -> bool:
        if not self.collection_is_completed or self.queue or self.steal is not None:
            return False
        return all(len(p) < BUSY_PENDING for p in self.pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.queue) or any(self.pending.values())

    def add_node(self, node: WorkerController) -> None:
        assert node not in self.pending
        self.pending[node] = []

    def add_node_collection(self, node: WorkerController, collection: Sequence[str]) -> None:
        self.collections[node] = list(collection)
        if self.collection is not None:  # a replacement worker, after scheduling began
            self._adopt(node)

    def _adopt(self, node: WorkerController) -> None:
        """Map the worker's indices to the scheduler's; a worker that collected other tests (not
        only in another order) gets no work."""
        collection = self.collections[node]
        if len(collection) != len(self.collection) or set(collection) != set(self.index_of):
            del self.collections[node]
            self._say(
                f"xdist-megatron: {node.gateway.id} collected other tests than "
                f"{self.collected_by} ({len(collection)} against {len(self.collection)}): it "
                "gets no work"
            )
            return
        self.local_index[node] = {nodeid: i for i, nodeid in enumerate(collection)}

    def _to_global(self, node: WorkerController, indices: Sequence[int]) -> list[int]:
        collection = self.collections[node]
        return [self.index_of[collection[i]] for i in indices]

    def _to_local(self, node: WorkerController, indices: Sequence[int]) -> list[int]:
        local = self.local_index[node]
        return [local[self.collection[i]] for i in indices]

    def mark_test_complete(
        self, node: WorkerController, item_index: int, duration: float = 0
    ) -> None:
        self.pending[node].remove(self._to_global(node, [item_index])[0])
        self._fill()

    def mark_test_pending(self, item: str) -> None:
        """A test handed back to run again (a `pytest_handlecrashitem` hook's choice)."""
        self._enqueue([item])
        self._fill()

    def remove_pending_tests_from_node(
        self, node: WorkerController, indices: Sequence[int]
    ) -> None:
        """The answer to a steal: the tests `node` gave back (none when it had begun one of
        them), which go to the worker they were asked for, else back to the queue."""
        steal, self.steal = self.steal, None
        indices = self._to_global(node, indices) if node in self.collections else []
        taken = set(indices)
        if node in self.pending:
            self.pending[node] = [i for i in self.pending[node] if i not in taken]
        if taken:
            thief = steal.thief if steal is not None and steal.victim is node else None
            if thief is not None and thief in self.pending and not thief.shutting_down:
                self._send_indices(thief, list(indices))
            else:
                self._enqueue([self.collection[i] for i in indices])
        self._fill()

    def remove_node(self, node: WorkerController) -> str | None:
        """A worker left: its running test is the crash item, the rest of its work is requeued."""
        pending = self.pending.pop(node)
        if self.steal is not None and node is self.steal.victim:
            self.steal = None  # a worker that left answers nothing
        if not pending or self.collection is None:
            self._fill()
            return None
        crashed, *rest = (self.collection[i] for i in pending)
        self._enqueue(rest)
        self._fill()
        return crashed

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is None:
            # The most tests, of the lowest worker: where a module failed to import on some
            # workers, those collected fewer.
            live = sorted(
                (n for n in self.collections if n in self.pending), key=self._worker_index
            )
            chosen = max(live, key=lambda n: len(self.collections[n]), default=None)
            self.collection = self.collections[chosen] if chosen is not None else []
            self.collected_by = chosen.gateway.id if chosen is not None else ""
            self.index_of = {nodeid: i for i, nodeid in enumerate(self.collection)}
            for node in [n for n in self.collections if n in self.pending]:
                self._adopt(node)
            self.infos = self._item_info()
            self._enqueue(self.collection)
        self._fill()

    # -- placement --------------------------------------------------------------------------

    def _enqueue(self, nodeids: Sequence[str]) -> None:
        units: dict[tuple[str, int | None, bool, str | None], Unit] = {}
        unknown = sharding.typical_duration(self._durations.values())
        for nodeid in nodeids:
            info = self._info(nodeid)
            key = (info.module, info.world_size, info.exclusive, info.whole)
            unit = units.setdefault(key, Unit(info.module, info.world_size, info.exclusive))
            unit.whole = info.whole is not None
            unit.nodeids.append(nodeid)
            duration = self._durations.get(nodeid, unknown)
            unit.duration += duration
            self.estimates[self.index_of[nodeid]] = duration
        self.queue.extend(units.values())
        self._sort_queue()

    def _sort_queue(self) -> None:
        self.queue.sort(key=lambda unit: unit.priority(self.devices))

    def world_size_of(self, nodeid: str) -> int | None:
        """The test's world size, as its worker published it (None: unmarked)."""
        return self._info(nodeid).world_size

    def _world_size(self, index: int) -> int | None:
        return self._info(self.collection[index]).world_size

    def _devices_of(self, worker: int, world_size: int | None) -> frozenset[int]:
        return placement.positions(self.devices, worker, world_size)

    def _fits(self, busy: Counter[int], devices: Collection[int], exclusive: bool) -> bool:
        """Whether a gang fits `devices` beside the gangs `busy` counts on each: one more slot
        of each, or every slot for an exclusive one."""
        need = self.devices.slots_for(exclusive)
        return all(busy[d] + need <= self.devices.gangs_per_device for d in devices)

    def _load(self, worker: int, indices: Sequence[int]) -> Counter[int]:
        """The slots a worker's tests `indices` take of each device: one of each device they
        use (it runs one test at a time), every one of those an exclusive test uses."""
        load: Counter[int] = Counter()
        for index in indices:
            info = self._info(self.collection[index])
            weight = self.devices.slots_for(info.exclusive)
            for device in self._devices_of(worker, info.world_size):
                load[device] = max(load[device], weight)
        return load

    def _info(self, nodeid: str) -> ItemInfo:
        return self.infos.get(nodeid) or ItemInfo(module_of(nodeid), None, None)

    def _fill(self) -> None:
        """Give work to every worker that is not busy (`BUSY_PENDING`), where devices allow:
        whole queued units first, then the end of another worker's queue; release the rest."""
        if self.collection is None:
            return
        self._assign_queued()
        self._rebalance()
        if self.queue and self.steal is None:
            self._unblock()
        self._release_idle()
        self._publish_plan()

    def _assign_queued(self) -> None:
        progress = True
        while self.queue and progress:
            progress = False
            hungry = self._hungry()
            # A worker holding back a test first: more work lets that test start.
            hungry.sort(key=lambda n: (-len(self.pending[n]), self._choices(n)))
            for node in hungry:
                # Fill one worker before the next: a worker given a single test holds it back
                # (reserving nothing) while the others' work would take its devices.
                while len(self.pending[node]) < BUSY_PENDING and self._assign_fitting(node, hungry):
                    progress = True

    def _hungry(self) -> list[WorkerController]:
        return [n for n in self._workers() if len(self.pending[n]) < BUSY_PENDING]

    def _publish_plan(self) -> None:
        """Tell the workers which gang sizes they may still need (the rest they shut down)."""
        pending = {
            self._worker_index(node): {self._world_size(index) or 0 for index in indices}
            for node, indices in self.pending.items()
        }
        unassigned = {unit.world_size or 0 for unit in self.queue}
        self.plan = sidechannel.plan(unassigned, pending)
        if self.session_dir is not None:
            sidechannel.write_plan(self.session_dir, unassigned, pending)

    def _workers(self) -> list[WorkerController]:
        live = [n for n in self.pending if n in self.collections and not n.shutting_down]
        return sorted(live, key=lambda n: (len(self.pending[n]), self._worker_index(n)))

    def _choices(self, node: WorkerController) -> int:
        """How many queued units fit this worker now (the most constrained chooses first)."""
        busy = self._occupied(exclude=node)
        worker = self._worker_index(node)
        devices = self._devices_of
        return sum(self._fits(busy, devices(worker, u.world_size), u.exclusive) for u in self.queue)

    def _worker_index(self, node: WorkerController) -> int:
        return int(node.workerinput[INPUT_KEY]["worker"])

    def _assign_fitting(self, node: WorkerController, hungry: list[WorkerController]) -> bool:
        """Send `node` the first unit that fits beside the running work, unless another hungry
        worker with the same devices for that unit already has a gang of its size."""
        busy = self._occupied(exclude=node)
        worker = self._worker_index(node)
        for unit in self.queue:
            devices = self._devices_of(worker, unit.world_size)
            if not self._fits(busy, devices, unit.exclusive):
                continue
            if self._gang_elsewhere(node, unit, devices, hungry):
                continue
            self._send(node, self._share(node, unit, devices, hungry))
            return True
        return False

    def _share(
        self,
        node: WorkerController,
        unit: Unit,
        devices: frozenset[int],
        hungry: list[WorkerController],
    ) -> Unit:
        """The part of `unit` to send `node`: all of it, unless other blocks of its size sit
        idle (empty workers that nothing else queued fits, on free devices apart from `node`'s)
        and splitting it between them ends it sooner despite `SPLIT_COST`; the other parts go
        back to the queue, for those workers."""
        if len(unit.nodeids) < 2 or unit.whole:
            return unit
        idle = self._idle_blocks(node, unit, devices, hungry)
        durations = [self.estimates[self.index_of[n]] for n in unit.nodeids]
        sizes = split_evenly(durations, 1 + len(idle), SPLIT_COST)
        if len(sizes) == 1:
            return unit
        parts, start = [], 0
        for size in sizes:
            part = Unit(
                unit.module, unit.world_size, unit.exclusive, unit.nodeids[start : start + size]
            )
            part.duration = sum(durations[start : start + size])
            parts.append(part)
            start += size
        self.queue.remove(unit)
        self.queue.extend(parts)
        self._sort_queue()
        self._log(f"split {unit.module} ws{unit.world_size} into {sizes}")
        return parts[0]

    def _idle_blocks(
        self,
        node: WorkerController,
        unit: Unit,
        devices: frozenset[int],
        hungry: list[WorkerController],
    ) -> list[frozenset[int]]:
        """Blocks of the unit's size whose workers are empty and fit no other queued unit, with
        a slot for a part of it beside the running work, `node`'s part and each other's."""
        weight = self.devices.slots_for(unit.exclusive)
        planned: Counter[int] = Counter(dict.fromkeys(devices, weight))
        blocks: list[frozenset[int]] = []
        for other in hungry:
            if other is node or self.pending[other]:
                continue
            theirs = self._devices_of(self._worker_index(other), unit.world_size)
            busy = self._occupied(exclude=other)
            if not self._fits(busy + planned, theirs, unit.exclusive):
                continue
            if self._fits_other(other, unit, busy):
                continue
            planned.update(dict.fromkeys(theirs, weight))
            blocks.append(theirs)
        return blocks

    def _fits_other(self, node: WorkerController, unit: Unit, busy: Counter[int]) -> bool:
        worker = self._worker_index(node)
        return any(
            u is not unit and self._fits(busy, self._devices_of(worker, u.world_size), u.exclusive)
            for u in self.queue
        )

    def _gang_elsewhere(
        self,
        node: WorkerController,
        unit: Unit,
        devices: frozenset[int],
        hungry: list[WorkerController],
    ) -> bool:
        """Whether a hungry worker other than `node` has run gangs of the unit's size on the
        same devices, where the unit fits too: it reuses its gang instead of `node` forking one,
        and no parallelism is lost (both would run the unit on the same devices)."""
        if unit.world_size is None or unit.world_size in self.world_sizes_sent.get(node, ()):
            return False
        for other in hungry:
            if other is node or len(self.pending[other]) >= BUSY_PENDING:
                continue
            if unit.world_size not in self.world_sizes_sent.get(other, ()):
                continue
            index = self._worker_index(other)
            if self._devices_of(index, unit.world_size) != devices:
                continue
            if self._fits(self._occupied(exclude=other), devices, unit.exclusive):
                return True
        return False

    # -- splitting: steals ------------------------------------------------------------------

    def _rebalance(self) -> None:
        """Ask a worker for the end of its queue for a hungry worker that nothing queued fits,
        where that ends both sooner (one request at a time, as `worksteal` does)."""
        if self.steal is not None:
            return
        best: tuple[float, WorkerController, WorkerController, list[int]] | None = None
        for thief in self._hungry():
            for victim in self.pending:
                if victim is thief or len(self.pending[victim]) <= BUSY_PENDING:
                    continue
                gain, indices = self._steal_gain(victim, thief)
                if indices and (best is None or gain > best[0]):
                    best = (gain, victim, thief, indices)
        if best is not None:
            _, victim, thief, indices = best
            self.steal = Steal(victim, thief, tuple(indices))
            victim.send_steal(self._to_local(victim, indices))
            self._log(f"{thief.gateway.id} steals {len(indices)} from {victim.gateway.id}")

    def _steal_gain(
        self, victim: WorkerController, thief: WorkerController
    ) -> tuple[float, list[int]]:
        """Seconds saved, and the tests to take, when `thief` takes the end of `victim`'s queue:
        as many as end both sooner, among those whose devices on the thief are free."""
        takeable = self._takeable_tail(victim, thief)
        left = sum(self.estimates.get(i, 0.0) for i in self.pending[victim])
        ahead = sum(self.estimates.get(i, 0.0) for i in self.pending[thief])
        durations = [self.estimates.get(i, 0.0) for i in takeable]
        count, finish = split_point(left, ahead, durations, SPLIT_COST)
        # While work is queued a worker left with one test would hold it back (no shutdown
        # comes to let it run): a steal must make the thief busy.
        short = self.queue and len(self.pending[thief]) + count < BUSY_PENDING
        if count == 0 or short:
            return 0.0, []
        return max(left, ahead) - finish, takeable[len(takeable) - count :]

    def _takeable_tail(self, victim: WorkerController, thief: WorkerController) -> list[int]:
        """The longest end of `victim`'s queue, past what a steal cannot reach, whose tests fit
        the thief's devices clear of every other worker's work, the victim's remaining included."""
        pending = self.pending[victim]
        worker, thief_index = self._worker_index(victim), self._worker_index(thief)
        others = self._occupied(exclude=thief, also=victim)
        kept: list[Counter[int]] = [Counter()]  # kept[k]: the victim's load with pending[:k]
        for index in pending[:-1]:
            kept.append(kept[-1] | self._load(worker, [index]))
        start = len(pending)
        while start > BUSY_PENDING:
            info = self._info(self.collection[pending[start - 1]])
            if info.whole is not None:  # a class that runs on one worker
                break
            needs = self._devices_of(thief_index, info.world_size)
            if not self._fits(others + kept[start - 1], needs, info.exclusive):
                break
            start -= 1
        return pending[start:]

    def _unblock(self) -> None:
        """Every worker waits with at most its held-back test and nothing fits beside the others'
        held-back tests: xdist runs a worker's last test only once more work (or shutdown)
        arrives, so waiting longer would wait forever. Give the first unit to the first idle
        worker; its device locks make it wait for any device a held-back test is then using."""
        workers = self._workers()
        if not workers or any(len(self.pending[n]) >= BUSY_PENDING for n in workers):
            return
        idle = [n for n in workers if not self.pending[n]] or workers
        self._send(idle[0], self.queue[0])

    def _release_idle(self) -> None:
        """With nothing queued, shut down the workers nothing more will come to: all of them
        once no queue is long enough to steal from (shutdown lets held-back tests run), else
        those holding back a test for which no steal is under way."""
        if self.queue:
            return
        stealable = any(len(p) > BUSY_PENDING for p in self.pending.values())
        if self.steal is None and not stealable:
            for node in self._workers():
                node.shutdown()
            return
        for node in self._hungry():
            if self.pending[node] and self.steal is None:
                node.shutdown()

    def _occupied(
        self, exclude: WorkerController, also: WorkerController | None = None
    ) -> Counter[int]:
        """Slots of each device the other workers' pending tests take (not those of `exclude`,
        nor `also`: `_load`)."""
        busy: Counter[int] = Counter()
        for node, indices in self.pending.items():
            # A worker with one pending test holds it back until more work (or shutdown)
            # arrives: it runs nothing, so its devices are free; should it start that test
            # later, the device locks make it wait its turn.
            if node is exclude or node is also:
                continue
            if len(indices) < BUSY_PENDING and not node.shutting_down:
                continue
            busy.update(self._load(self._worker_index(node), indices))
        return busy

    def _send(self, node: WorkerController, unit: Unit) -> None:
        self.queue.remove(unit)
        self._send_indices(node, [self.index_of[nodeid] for nodeid in unit.nodeids])

    def _send_indices(self, node: WorkerController, indices: list[int]) -> None:
        self.pending[node].extend(indices)
        self.world_sizes_sent.setdefault(node, set()).update(self._world_size(i) for i in indices)
        node.send_runtest_some(self._to_local(node, indices))
        first = self._info(self.collection[indices[0]])
        self._log(f"{node.gateway.id}: {first.module} ws{first.world_size} x{len(indices)}")

    def _say(self, message: str) -> None:
        """A line in the terminal too: a worker left idle costs the run its share."""
        self._log(message)
        reporter = self.config.pluginmanager.get_plugin("terminalreporter") if self.config else None
        if reporter is not None:
            reporter.write_line(message, yellow=True)

    def _log(self, message: str) -> None:
        if self.log is not None:
            self.log(message)
