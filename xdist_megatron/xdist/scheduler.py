"""`--dist megatron`: xdist scheduling of (module, world size) units onto exclusive device blocks.

Units are all tests of one module with one world size (unmarked tests: one unit per module, on
the worker's home device). The largest sizes go first, then the longest known durations; a worker
gets a unit only when the unit's devices are free of every other worker's pending work, so gangs
on disjoint devices run at once. A worker holding back a test is served first and filled until
it is busy (`BUSY_PENDING`) before the next worker, and a unit goes to the worker that already
has a gang of its size on the same devices. Device locks in the workers keep this safe even when the
scheduler has to break a wait (see `_unblock`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from .. import placement, sidechannel
from ..ci import sharding
from ..protocol import INPUT_KEY, module_of
from ..sidechannel import ItemInfo

if TYPE_CHECKING:
    from xdist.workermanage import WorkerController

# xdist runs a worker's last pending test only once another one (or "shutdown") has arrived: a
# worker is busy only while it has this many pending, and one with fewer holds its test back.
BUSY_PENDING = 2


@dataclass
class Unit:
    """Tests of one module and one world size, sent to one worker together."""

    module: str
    world_size: int | None  # None: unmarked tests, run in the worker itself
    nodeids: list[str] = field(default_factory=list)
    duration: float = 0.0

    def priority(self) -> tuple:
        return (-(self.world_size or 1), -self.duration, self.module)


class MegatronScheduling:
    """xdist's Scheduling protocol over `placement`'s pure device functions."""

    def __init__(
        self,
        config: pytest.Config,
        devices: placement.DeviceSet,
        worker_count: int,
        item_info: Callable[[], dict[str, ItemInfo]],  # read once collection is done
        durations: dict[str, float],
        session_dir: str,
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
        self.index_of: dict[str, int] = {}
        self.world_sizes_sent: dict[WorkerController, set[int | None]] = {}  # each worker's gangs

    # -- the protocol -----------------------------------------------------------------------

    @property
    def nodes(self) -> list[WorkerController]:
        return list(self.pending)

    @property
    def collection_is_completed(self) -> bool:
        return self.collection is not None or len(self.collections) >= self.worker_count

    @property
    def tests_finished(self) -> bool:
        if not self.collection_is_completed or self.queue:
            return False
        return all(len(p) < BUSY_PENDING for p in self.pending.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.queue) or any(self.pending.values())

    def add_node(self, node: WorkerController) -> None:
        assert node not in self.pending
        self.pending[node] = []

    def add_node_collection(self, node: WorkerController, collection: Sequence[str]) -> None:
        if self.collection is not None and list(collection) != self.collection:
            self._log(f"{node.gateway.id} collected different tests; it gets no work")
            return
        self.collections[node] = list(collection)

    def mark_test_complete(
        self, node: WorkerController, item_index: int, duration: float = 0
    ) -> None:
        self.pending[node].remove(item_index)
        self._fill()

    def mark_test_pending(self, item: str) -> None:
        raise NotImplementedError("--dist megatron does not steal work")

    def remove_pending_tests_from_node(
        self, node: WorkerController, indices: Sequence[int]
    ) -> None:
        raise NotImplementedError("--dist megatron does not steal work")

    def remove_node(self, node: WorkerController) -> str | None:
        """A worker left: its running test is the crash item, the rest of its work is requeued."""
        pending = self.pending.pop(node)
        if not pending or self.collection is None:
            return None
        crashed, *rest = (self.collection[i] for i in pending)
        self._enqueue(rest)
        self._fill()
        return crashed

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is None:
            collections = [c for n, c in self.collections.items() if n in self.pending]
            self.collection = collections[0] if collections else []
            self.index_of = {nodeid: i for i, nodeid in enumerate(self.collection)}
            self.infos = self._item_info()
            self._enqueue(self.collection)
        self._fill()

    # -- placement --------------------------------------------------------------------------

    def _enqueue(self, nodeids: Sequence[str]) -> None:
        units: dict[tuple[str, int | None], Unit] = {}
        unknown = sharding.typical_duration(self._durations.values())
        for nodeid in nodeids:
            info = self._info(nodeid)
            key = (info.module, info.world_size)
            unit = units.setdefault(key, Unit(info.module, info.world_size))
            unit.nodeids.append(nodeid)
            unit.duration += self._durations.get(nodeid, unknown)
        self.queue.extend(units.values())
        self.queue.sort(key=Unit.priority)

    def world_size_of(self, nodeid: str) -> int | None:
        """The test's world size, as its worker published it (None: unmarked)."""
        return self._info(nodeid).world_size

    def _world_size(self, index: int) -> int | None:
        return self._info(self.collection[index]).world_size

    def _devices_of(self, worker: int, world_size: int | None) -> frozenset[int]:
        return placement.positions(self.devices, worker, world_size)

    def _info(self, nodeid: str) -> ItemInfo:
        return self.infos.get(nodeid) or ItemInfo(module_of(nodeid), None, None)

    def _fill(self) -> None:
        """Give work to every worker that is not busy (`BUSY_PENDING`), where devices allow."""
        if self.collection is None:
            return
        progress = True
        while self.queue and progress:
            progress = False
            hungry = [n for n in self._workers() if len(self.pending[n]) < BUSY_PENDING]
            # A worker holding back a test first: more work lets that test start.
            hungry.sort(key=lambda n: (-len(self.pending[n]), self._choices(n)))
            for node in hungry:
                # Fill one worker before the next: a worker given a single test holds it back
                # (reserving nothing) while the others' work would take its devices.
                while len(self.pending[node]) < BUSY_PENDING and self._assign_fitting(node, hungry):
                    progress = True
        if self.queue:
            self._unblock()
        else:
            for node in self._workers():
                node.shutdown()
        self._publish_plan()

    def _publish_plan(self) -> None:
        """Tell the workers which gang sizes they may still need (the rest they shut down)."""
        pending = {
            self._worker_index(node): {self._world_size(index) or 0 for index in indices}
            for node, indices in self.pending.items()
        }
        unassigned = {unit.world_size or 0 for unit in self.queue}
        sidechannel.write_plan(self.session_dir, unassigned, pending)

    def _workers(self) -> list[WorkerController]:
        live = [n for n in self.pending if n in self.collections and not n.shutting_down]
        return sorted(live, key=lambda n: (len(self.pending[n]), self._worker_index(n)))

    def _choices(self, node: WorkerController) -> int:
        """How many queued units fit this worker now (the most constrained chooses first)."""
        busy = self._occupied(exclude=node)
        worker = self._worker_index(node)
        fits = (busy.isdisjoint(self._devices_of(worker, u.world_size)) for u in self.queue)
        return sum(fits)

    def _worker_index(self, node: WorkerController) -> int:
        return int(node.workerinput[INPUT_KEY]["worker"])

    def _assign_fitting(self, node: WorkerController, hungry: list[WorkerController]) -> bool:
        """Send `node` the first unit that fits beside the running work, unless another hungry
        worker with the same devices for that unit already has a gang of its size."""
        busy = self._occupied(exclude=node)
        worker = self._worker_index(node)
        for unit in self.queue:
            devices = self._devices_of(worker, unit.world_size)
            if busy & devices or self._gang_elsewhere(node, unit, devices, hungry):
                continue
            self._send(node, unit)
            return True
        return False

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
            if not self._occupied(exclude=other) & devices:
                return True
        return False

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

    def _occupied(self, exclude: WorkerController) -> frozenset[int]:
        devices: set[int] = set()
        for node, indices in self.pending.items():
            # A worker with one pending test holds it back until more work (or shutdown)
            # arrives: it runs nothing, so its devices are free; should it start that test
            # later, the device locks make it wait its turn.
            if node is exclude or (len(indices) < BUSY_PENDING and not node.shutting_down):
                continue
            worker = self._worker_index(node)
            for index in indices:
                devices |= self._devices_of(worker, self._world_size(index))
        return frozenset(devices)

    def _send(self, node: WorkerController, unit: Unit) -> None:
        self.queue.remove(unit)
        indices = [self.index_of[nodeid] for nodeid in unit.nodeids]
        self.pending[node].extend(indices)
        self.world_sizes_sent.setdefault(node, set()).add(unit.world_size)
        node.send_runtest_some(indices)
        self._log(f"{node.gateway.id}: {unit.module} ws{unit.world_size} x{len(indices)}")

    def _log(self, message: str) -> None:
        if self.log is not None:
            self.log(message)
